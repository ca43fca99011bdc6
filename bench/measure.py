"""The benchmark's measurements. Each returns plain numbers; bench/__main__.py runs them in one go."""

from __future__ import annotations

import asyncio
import contextlib
import json
import platform
import random
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from bench import loadgen
from loadtest.run import LocalServer, free_port, local_server, wait_listening, wait_serving, wait_workers_loaded
from server.backend.ort import OnnxRuntime, RuntimeOptions, pad_rows
from server.core.batcher import Backend, Batcher, BatchObserver, BatchPolicy

ROOT = Path(__file__).resolve().parents[1]
TRAFFIC_TEXTS = 3000  # held-out WordNet texts in the benchmark's length mix
SETTLE_SECONDS = 0.3  # idle before each timed block (see interleaved_medians)
Reading = dict[str, Any]  # one load generator's JSON (bench/loadgen.py), or several merged


def cpu_name() -> str:
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return names[0] if names else platform.processor() or "unknown"


def nvidia_smi(fields: str) -> list[str]:
    """The first GPU's values of nvidia-smi's comma-separated query fields; [] where nvidia-smi does not tell."""
    query = ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"]
    done = subprocess.run(query, capture_output=True, text=True)
    return done.stdout.strip().splitlines()[0].split(", ") if done.returncode == 0 and done.stdout.strip() else []


def gpu_name() -> str:
    name, driver = [*nvidia_smi("name,driver_version"), "", ""][:2]
    return f"{name} (driver {driver})" if driver else name


@contextmanager
def texts_on_disk(texts: list[str]) -> Iterator[Path]:
    """The texts as the JSON file the load generator reads, for as long as the block runs."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "texts.json"
        path.write_text(json.dumps(texts))
        yield path


def forward_flops(config: Mapping[str, Any], batch: int, sequence: int) -> float:
    """Forward FLOPs of one padded batch (2 per multiply-add): projections, feed-forward, attention."""
    d, d_ff = config["d_model"], config["d_ff"]
    per_token = 8 * d**2 + 4 * d * d_ff + 4 * sequence * d  # the last: QK^T and weights @ V
    return batch * sequence * config["n_layers"] * per_token


class BatchRecorder(BatchObserver):
    """Real and padded tokens of every batch the batcher starts."""

    real = padded = 0

    def batch_started(self, items: int, real_tokens: int, padded_tokens: int, queue_waits: list[float]) -> None:
        self.real += real_tokens
        self.padded += padded_tokens


def traffic(n: int = TRAFFIC_TEXTS) -> list[str]:
    """The benchmark's texts: the same n held-out WordNet texts, in its length mix, on every call."""
    from loadtest.texts import load_pool

    return load_pool().mixed(random.Random(0), n)


def through_batcher(backend: Backend, rows: Sequence[np.ndarray], policy: BatchPolicy, clients: int,
                    observer: BatchObserver | None = None) -> None:  # fmt: skip
    """Every row through the real batcher, in order, from ``clients`` closed-loop clients sending one row a request."""

    async def run() -> None:
        batcher = Batcher(backend, policy, observer=observer)
        batcher.start()
        left = iter(rows)  # shared: each client takes the next row when its last one is answered

        async def client() -> None:
            for row in left:
                await batcher.submit([row])

        await asyncio.gather(*(client() for _ in range(clients)))
        await batcher.close()

    asyncio.run(run())


def plan_batches(rows: Sequence[np.ndarray], policy: BatchPolicy) -> list[list[np.ndarray]]:
    """The batches the server's batcher forms when every row is queued at once (a full queue)."""
    batches: list[list[np.ndarray]] = []

    def record(batch: Sequence[np.ndarray]) -> np.ndarray:
        batches.append(list(batch))
        return np.zeros((len(batch), 1), dtype=np.float32)

    through_batcher(record, rows, replace(policy, max_queue_tokens=10**9), len(rows))
    return batches


def time_batches(runtime: OnnxRuntime, batches: list[list[np.ndarray]], repeats: int = 3) -> float:
    """Best wall time of running every batch back to back (inputs padded beforehand)."""
    padded = [pad_rows(b, runtime.pad_id) for b in batches]

    def run_all() -> None:
        for ids, mask in padded:
            runtime.run(ids, mask)

    return min(wall_seconds(run_all) for _ in range(repeats))


def padding_waste(runtime: OnnxRuntime, rows: Sequence[np.ndarray], policy: BatchPolicy, concurrency: int) -> float:
    """Closed-loop traffic through the real batcher and ONNX Runtime: padded share of computed tokens."""
    recorder = BatchRecorder()
    through_batcher(runtime.run_rows, rows[::-1], policy, concurrency, recorder)  # the last row first
    return (recorder.padded - recorder.real) / recorder.padded


def wall_seconds(fn: Callable[[], object]) -> float:
    """Wall seconds of one call."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def median_seconds(fn: Callable[[], object], repeats: int = 30, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    return float(np.median([wall_seconds(fn) for _ in range(repeats)]))


def interleaved_medians(backends: dict[str, Callable[[], object]], rounds: int = 8) -> dict[str, float]:
    """Median seconds per call of each backend, in interleaved rounds, so that every backend sees the machine's
    drift. Each block starts after an idle pause, so that the thread pools that busy-wait after their work (OpenMP's,
    ONNX Runtime's) are asleep before the next backend needs the cores: without it eager PyTorch read 26 to 43 ms."""
    samples: dict[str, list[float]] = {name: [] for name in backends}
    for _ in range(rounds):
        for name, fn in backends.items():
            time.sleep(SETTLE_SECONDS)
            samples[name].append(median_seconds(fn, repeats=6, warmup=2))
    return {name: float(np.median(values)) for name, values in samples.items()}


def per_batch_latency(
    model_dir: Path, ids: np.ndarray, mask: np.ndarray, provider: str = "cpu", torch_threads: int = 0
) -> dict[str, float]:
    """Median seconds for one padded batch, interleaved: ONNX Runtime fp32 and int8 (fp32 and fp16 on CUDA);
    with torch_threads, eager PyTorch and TorchScript on the CPU beside them."""
    precisions = ("fp32", "fp16" if provider == "cuda" else "int8")
    sessions = {
        p: OnnxRuntime(model_dir, RuntimeOptions(provider=provider, precision=p, spinning=True), 0) for p in precisions
    }
    backends: dict[str, Callable[[], object]] = {
        f"ONNX Runtime {p}": partial(s.run, ids, mask) for p, s in sessions.items()
    }
    if not torch_threads:
        return interleaved_medians(backends)
    import torch

    from export.torchscript import load_torchscript
    from model.checkpoint import load_checkpoint

    torch.set_num_threads(torch_threads)
    model, _ = load_checkpoint(model_dir / "checkpoint.pt")
    scripted = load_torchscript(model_dir / "model.torchscript.pt")
    t_ids, t_mask = torch.from_numpy(ids), torch.from_numpy(mask)
    with torch.inference_mode():
        return interleaved_medians({"eager PyTorch": lambda: model(t_ids, t_mask),
                                    "TorchScript": lambda: scripted(t_ids, t_mask), **backends})  # fmt: skip


# What the FLOP table's peak is read with. ONNX Runtime's MatMul runs on the kernels (MLAS) that every served
# product runs on; torch's wheel multiplies with MKL, which on AMD CPUs reached about half that rate.
MATMUL_PEAK_KERNEL = "ONNX Runtime MatMul"


def matmul_session(n: int, threads: int) -> tuple[Any, dict[str, np.ndarray]]:
    """A CPU session holding one fp32 (n, n) x (n, n) MatMul, and inputs for it."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    square = [helper.make_tensor_value_info(name, TensorProto.FLOAT, [n, n]) for name in ("a", "b", "c")]
    graph = helper.make_graph([helper.make_node("MatMul", ["a", "b"], ["c"])], "matmul", square[:2], square[2:])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9  # what this onnxruntime reads; the onnx package writes newer ones by default
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    return session, {name: rng.standard_normal((n, n), dtype=np.float32) for name in ("a", "b")}


def matmul_peak_flops(threads: int, n: int = 2048) -> float:
    """This machine's measured fp32 matrix-multiply rate (FLOP/s) with the given threads (MATMUL_PEAK_KERNEL)."""
    session, feeds = matmul_session(n, threads)
    return 2 * n**3 / median_seconds(lambda: session.run(None, feeds), repeats=10)


def load(target: str, concurrency: int, texts_file: Path, duration: float, per_request: int = 1,
         protocol: str = "grpc", watch_pid: int | None = None, processes: int = 1) -> Reading:  # fmt: skip
    """One reading of `python -m bench.loadgen`: `concurrency` clients sending `per_request` texts each; with several
    `processes`, that many load generators at once (one connection and one core each, as a `--workers` server needs),
    their rates added up and latency percentiles over all their requests."""
    command = [sys.executable, "-m", "bench.loadgen", "--target", target, "--texts", str(texts_file)]
    command += [f"--concurrency={concurrency}", f"--duration={duration}", f"--texts-per-request={per_request}"]
    command += [f"--protocol={protocol}", *([f"--watch-pid={watch_pid}"] if watch_pid else [])]
    command += ["--raw-latencies"] if processes > 1 else []
    running = [subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE) for _ in range(processes)]
    readings = [json.loads(p.communicate()[0]) for p in running]
    if any(p.returncode for p in running):
        raise RuntimeError(f"a load generator failed against {target}")
    reading = readings[0] if processes == 1 else merge_readings(readings)
    kinds = f" {reading['error_kinds']}" if reading["errors"] else ""
    print(
        f"  {protocol} {processes} x c={concurrency} x {per_request} texts: {reading['texts_per_second']:.0f} texts/s, "
        f"p50 {reading['p50_ms']:.2f} ms, p99 {reading['p99_ms']:.2f} ms, errors {reading['errors']}{kinds}",
        flush=True,
    )
    return reading


def load_sweep(target: str, concurrencies: Sequence[int], *args: Any, **options: Any) -> list[Reading]:
    """One `load` reading per concurrency level, in turn; the readings in that order."""
    return [load(target, concurrency, *args, **options) for concurrency in concurrencies]


def merge_counts(counts: Iterable[Mapping[str, int]]) -> dict[str, int]:
    """Error counts by kind, added up."""
    return dict(sum((Counter(one) for one in counts), Counter()))


def merge_readings(readings: list[Reading]) -> Reading:
    """Several load generators' readings as one: rates added, percentiles over every request's latency."""
    ms = np.concatenate([np.asarray(r["latencies_ms"], dtype=float) for r in readings])
    added = ("concurrency", "texts_per_second", "requests_per_second", "errors")
    return {key: sum(r[key] for r in readings) for key in added} | {
        "processes": len(readings),
        "texts_per_request": readings[0]["texts_per_request"],
        **loadgen.percentiles(ms),
        "error_kinds": merge_counts(r["error_kinds"] for r in readings),
    }


def workers_reading(model_dir: Path, flags: Sequence[str], workers: int, processes: int, texts_file: Path,
                    duration: float, after_load: Callable[[], Reading] | None = None) -> Reading:  # fmt: skip
    """A server with `--workers` loaded by `processes` load generators, one connection each (the kernel hands a
    connection to one worker, so one connection would load one worker only): 128 clients of one text, then 32
    of 8 texts; then after_load's readings (GPU memory, say) while the server still runs."""
    metrics_port = free_port()
    extra = [*flags, "--workers", str(workers), "--metrics-port", str(metrics_port)]
    with local_server(str(model_dir), extra) as server:
        wait_workers_loaded(metrics_port, workers)
        single = load(server.target, 128 // processes, texts_file, duration, processes=processes)
        batch8 = load(server.target, 32 // processes, texts_file, duration, 8, processes=processes)
        return {"single": single, "batch8": batch8, **(after_load() if after_load else {})}


@contextmanager
def transport_server(dim: int, protocol: str = "grpc") -> Iterator[LocalServer]:
    """bench/transport.py in its own process: the same request answered with a fixed vector, no model."""
    port = free_port()
    command = [sys.executable, "-m", "bench.transport", "--port", str(port), "--dim", str(dim)]
    process = subprocess.Popen([*command, "--protocol", protocol], cwd=ROOT)
    target = f"127.0.0.1:{port}"
    try:
        wait_serving(target, process=process) if protocol == "grpc" else wait_listening(process, port)
        yield LocalServer(target, process, f"http://{target}")
    finally:
        process.terminate()
        process.wait(30)


def server_limits(http_url: str) -> dict[str, int]:
    """What a running server measured at its own warm-up for its default model (`GET /info`): its one-thread
    and event-loop limits and its batch token budget, which move from one start to the next."""
    with urllib.request.urlopen(f"{http_url}/info", timeout=10) as answer:
        model = next(m for m in json.load(answer)["models"] if m["is_default"])
    return {key: model[key] for key in ("one_thread_batch_tokens", "inline_batch_tokens", "max_batch_tokens")}


def compare_protocols(server: LocalServer, dim: int, texts_file: Path, seconds: float, rounds: int,
                      loads: Sequence[tuple[int, int]], server_pid: int,
                      ceilings: Sequence[str] = ("http",)) -> dict[str, dict[str, list[Reading]]]:  # fmt: skip
    """Each load (texts per request, clients) over gRPC, over HTTP and on each transport ceiling asked for (a
    minimal server on the same stack answering a fixed vector: "http", "grpc"), all from the same load generator;
    rounds interleaved, so that the machine's drift hits every target alike, and every other round in reverse
    order, so that a drift within a round does not always fall on the target read last. Readings by load
    ("1x32"), then target, one per round, each with its round, its place in that round's order and the CPU a
    request cost the threads of the process that answered it (server_pid's, or the ceiling's)."""
    results: dict[str, dict[str, list[Reading]]] = {}
    with contextlib.ExitStack() as stack:
        targets = {  # each with the process that answers it and the protocol it speaks
            "grpc": (server.target, server_pid, "grpc"),
            "http": (server.http.removeprefix("http://"), server_pid, "http"),
        }
        for protocol in ceilings:
            ceiling = stack.enter_context(transport_server(dim, protocol))
            targets[f"{protocol} ceiling"] = (ceiling.target, ceiling.process.pid, protocol)
        for round_ in range(rounds):
            order = list(targets.items())[:: -1 if round_ % 2 else 1]
            for per_request, clients in loads:
                for place, (name, (target, pid, protocol)) in enumerate(order):
                    reading = load(target, clients, texts_file, seconds, per_request, protocol, pid)
                    reading |= {"round": round_, "place": place}
                    results.setdefault(f"{per_request}x{clients}", {}).setdefault(name, []).append(reading)
    return results


def raw_rates(
    runtime: OnnxRuntime, rows: Sequence[np.ndarray], loads: Sequence[tuple[int, int]], policy: BatchPolicy
) -> dict[str, float]:
    """The model alone, texts/s on each load's batches: c clients sending k texts each form batches of at
    most c x k texts, so the rows run in windows of that many, batched as the batcher batches a full queue."""
    rates = {}
    for per_request, clients in loads:
        window = per_request * clients
        batches = [b for i in range(0, len(rows), window) for b in plan_batches(rows[i : i + window], policy)]
        rates[f"{per_request}x{clients}"] = len(rows) / time_batches(runtime, batches, repeats=1)
    return rates


def serial_limit(raw_texts_per_second: float, transport_texts_per_second: float) -> float:
    """Texts/s when the model's and the transport's costs are paid one after the other on the same cores."""
    return 1.0 / (1.0 / raw_texts_per_second + 1.0 / transport_texts_per_second)
