"""`make bench`: every speed figure of the project, measured side by side in one run.

    python -m bench [--model-dir artifacts] [--duration 8] [--out docs] [--provider cpu|cuda]

The trained model over gRPC and HTTP against its raw ONNX Runtime ceiling and the transport ceilings;
then all-MiniLM-L6-v2 (ARTIFACTS/minilm), where compute dominates, so batching, padding and int8 show
what they are worth. Writes docs/benchmarks.md (targets, tables, machine, settings), docs/benchmarks.json
and two plots. The README's speed claims come from that file only.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from bench import measure, null_model
from bench.report import targets, write_report
from contract.manifest import MANIFEST_FILE, Manifest
from loadtest.run import local_server
from server.backend.ort import OnnxRuntime, RuntimeOptions, pad_rows
from server.config import ServerConfig
from server.core.batcher import BatchPolicy
from server.core.tokenizer import TextTokenizer
from server.loading import batch_policy, batch_token_budget

CONCURRENCY = (1, 8, 32, 64, 128)
BATCH8_CONCURRENCY = (4, 16, 32)
TRANSPORT_SINGLE = (1, 32, 128)  # the levels the serial limit is reported at, one text per request
TRANSPORT_BATCH8 = (16,)
PROTOCOL_LOADS = [(1, 32), (8, 16), (1, 1)]  # (texts per request, clients): HTTP against gRPC
MINILM_PROTOCOL_LOADS = [(1, 32), (8, 16)]
# Five: the median then ignores two readings taken in stalls of the shared machine; three rounds could not tell
# all-MiniLM-L6-v2's 5% target from the noise of its short readings.
PROTOCOL_ROUNDS = 5
# The request path alone (a model that costs nothing): the loads every change to the hot path is judged by.
REQUEST_PATH_LOADS = [(1, 32), (1, 128), (8, 16)]
MINILM_CONCURRENCY = (32, 128)
MINILM_TEXTS = 1000  # rows for all-MiniLM-L6-v2's raw ceiling and padding runs (about 20x slower per text)
# Where compute dominates, ONNX Runtime's spinning threads pay for themselves (README, --intra-op-spinning).
MINILM_FLAGS = ["--intra-op-spinning", "true"]
WORKERS = 2
WORKER_CONNECTIONS = 4  # load-generator processes (one connection each) in the workers comparison


def onnx_parameters(path: Path) -> int:
    import onnx

    return int(sum(np.prod(init.dims) for init in onnx.load(str(path)).graph.initializer))


def measure_transport(dim: int, texts_file: Path, duration: float) -> dict[str, list[measure.Reading]]:
    print("transport ceiling: the same proto answered with a fixed vector (bench/transport.py)", flush=True)
    sweep = partial(measure.load_sweep, texts_file=texts_file, duration=duration)
    with measure.transport_server(dim) as t:
        return {
            "single": sweep(t.target, TRANSPORT_SINGLE, watch_pid=t.process.pid),
            "batch8": sweep(t.target, TRANSPORT_BATCH8, per_request=8, watch_pid=t.process.pid),
        }


class WarmModel(NamedTuple):
    folder: Path
    manifest: Manifest
    tokenizer: TextTokenizer
    runtime: OnnxRuntime
    rows: list[np.ndarray]
    policy: BatchPolicy  # the server's for this model
    batches: list[list[np.ndarray]]  # as the server's batcher forms them from a full queue


def warm_model(folder: Path, texts: list[str], provider: str) -> WarmModel:
    """A model's manifest, tokenizer and warmed-up runtime (small batches on one thread where the server runs them
    so), its rows of the texts, and the batches the server forms of them: its default policy, the token budget
    lowered to what runs within --max-batch-seconds."""
    if not (folder / MANIFEST_FILE).is_file():
        raise SystemExit(f"{folder} holds no exported model: run `make export` (or `make export-pretrained`) first")
    manifest = Manifest.read(folder)
    tokenizer = TextTokenizer(folder / "tokenizer.json")
    rows = tokenizer.encode(texts, truncate=True).rows
    runtime = OnnxRuntime(folder, RuntimeOptions(provider=provider, spinning=True), pad_id=manifest.pad_id)
    defaults = ServerConfig()
    runtime.use_one_thread_up_to(defaults.one_thread_batch_tokens, tokenizer.max_length)  # small batches as served
    policy = batch_policy(defaults, batch_token_budget(runtime, defaults, tokenizer.max_length))
    runtime.warm_up(tokenizer.max_length, policy.max_batch_tokens, policy.max_batch_size)
    return WarmModel(folder, manifest, tokenizer, runtime, rows, policy, measure.plan_batches(rows, policy))


class Plan(NamedTuple):
    """What is measured of one served model."""

    flags: list[str]  # the server's, besides --provider
    levels: Sequence[int]  # clients in the batching sweep
    unbatched_levels: Sequence[int]  # clients in the --max-batch-size 1 sweep
    protocol_loads: list[tuple[int, int]]
    singles: int  # texts timed alone
    torch_threads: int = 0  # eager PyTorch and TorchScript per batch beside ONNX Runtime (a trained checkpoint)
    batch8_levels: Sequence[int] = ()  # clients sending 8 texts per request


def measure_model(w: WarmModel, plan: Plan, texts_file: Path, duration: float, provider: str) -> dict[str, Any]:
    """One served model: its raw ceiling before and after the servers, single-text time, the server with and
    without batching, HTTP against gRPC, padding and per-batch latency."""
    rows, runtime, batches, policy = w.rows, w.runtime, w.batches, w.policy
    readings = [len(rows) / measure.time_batches(runtime, batches)]
    print(f"  raw ceiling {readings[0]:.0f} texts/s", flush=True)
    runtime.run(*pad_rows(rows[:1], runtime.pad_id))  # one warm-up run, then each of the first texts alone in turn
    alone = [pad_rows([r], runtime.pad_id) for r in rows[: plan.singles]]
    singles = [measure.median_seconds(partial(runtime.run, *padded), 1, 0) for padded in alone]
    flags = [*plan.flags, "--provider", provider]
    sweep = partial(measure.load_sweep, texts_file=texts_file, duration=duration)
    with local_server(str(w.folder), flags) as server:
        pid = server.process.pid
        result = {
            "server_limits": measure.server_limits(server.http),
            "server": sweep(server.target, plan.levels, watch_pid=pid),
            "server_batch8": sweep(server.target, plan.batch8_levels, per_request=8, watch_pid=pid),
            "protocols": {
                "loads": measure.compare_protocols(
                    server, w.manifest.dim, texts_file, duration / 2, PROTOCOL_ROUNDS, plan.protocol_loads, pid
                ),
                "raw": measure.raw_rates(runtime, rows, plan.protocol_loads, policy),
            },
        }
    with local_server(str(w.folder), [*flags, "--max-batch-size", "1"]) as server:
        result["no_batching"] = sweep(server.target, plan.unbatched_levels)
    readings.append(len(rows) / measure.time_batches(runtime, batches))
    print(f"  raw ceiling again {readings[1]:.0f} texts/s", flush=True)
    ids, mask = pad_rows(rows[:32], runtime.pad_id)
    orders = {"sorted": policy, "fifo": replace(policy, length_sorted=False)}
    batch_provider = "cpu" if plan.torch_threads else provider  # beside eager PyTorch, which runs on the CPU
    config = w.manifest.config
    flops = sum(measure.forward_flops(config, len(b), max(len(r) for r in b)) for b in batches)
    # The machine's speed can drift over the run (shared VM): the server is compared against the higher of the
    # two readings, so the ratio is never flattered by a slow one.
    ceiling = {"texts_per_second": max(readings), "readings": readings, "flops_per_text": flops / len(rows),
               "batches": len(batches), "mean_batch": len(rows) / len(batches),
               "padded_tokens_per_text": sum(len(b) * max(len(r) for r in b) for b in batches) / len(rows),
               "real_tokens_per_text": sum(len(r) for r in rows) / len(rows)}  # fmt: skip
    return result | {
        "model_id": w.manifest.model_id,
        "config": config,
        "parameters": onnx_parameters(w.folder / "model.onnx"),
        "ceiling": ceiling,
        "max_batch_tokens": policy.max_batch_tokens,
        "single_text_ms": 1000 * float(np.median(singles)),
        "singles_per_second": len(singles) / sum(singles),
        "padding": {
            f"c={c}": {name: measure.padding_waste(runtime, rows, order, c) for name, order in orders.items()}
            for c in (32, 128)
        },
        "per_batch": {
            "shape": list(ids.shape),
            "seconds": measure.per_batch_latency(w.folder, ids, mask, batch_provider, plan.torch_threads),
        },
        "int8_cosine": w.manifest.precision.get("int8 vs fp32"),
        "int8_build": w.manifest.precision.get("int8_build"),
        "server_flags": plan.flags,
    }


def measure_request_path(model_dir: Path, texts_file: Path, duration: float, provider: str) -> dict[str, Any]:
    """The whole server on a model that costs nothing, behind the trained model's tokenizer, against both
    transport ceilings, in interleaved rounds: what the request path costs apart from any model."""
    with tempfile.TemporaryDirectory() as folder:
        null_dir = null_model.build(Path(folder), model_dir)
        with local_server(str(null_dir), ["--provider", provider]) as server:
            loads = measure.compare_protocols(
                server, null_model.NULL_DIM, texts_file, duration / 2, PROTOCOL_ROUNDS, REQUEST_PATH_LOADS,
                server.process.pid, ceilings=("http", "grpc"),
            )  # fmt: skip
    return {"loads": loads, "dim": null_model.NULL_DIM}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=Path("artifacts"))
    parser.add_argument("--minilm-dir", type=Path, help="all-MiniLM-L6-v2's export (default: MODEL_DIR/minilm)")
    parser.add_argument("--duration", type=float, default=8.0, help="seconds measured per concurrency level")
    parser.add_argument("--out", type=Path, default=Path("docs"))
    parser.add_argument("--provider", choices=("cpu", "cuda"), default="cpu", help="execution provider measured")
    args = parser.parse_args(argv)
    started = time.time()
    threads = os.cpu_count() or 1
    texts = measure.traffic()
    trained = warm_model(args.model_dir, texts, args.provider)
    minilm_dir = args.minilm_dir or args.model_dir / "minilm"
    minilm = warm_model(minilm_dir, texts[:MINILM_TEXTS], args.provider)  # fails early when it is missing
    with measure.texts_on_disk(texts) as texts_file:
        transport_readings = [measure_transport(trained.runtime.dim, texts_file, args.duration)]
        print("1. the trained model: raw ceiling, server with and without batching, HTTP against gRPC", flush=True)
        plan = Plan([], CONCURRENCY, CONCURRENCY, PROTOCOL_LOADS, 300, threads, BATCH8_CONCURRENCY)
        results = measure_model(trained, plan, texts_file, args.duration, args.provider)
        print(f"2. workers: 1 against --workers {WORKERS}, {WORKER_CONNECTIONS} connections", flush=True)
        flags = ["--provider", args.provider]
        results["workers"] = {"n": WORKERS, "connections": WORKER_CONNECTIONS} | {
            str(n): measure.workers_reading(args.model_dir, flags, n, WORKER_CONNECTIONS, texts_file, args.duration)
            for n in (1, WORKERS)
        }
        # Like the raw ceiling: read twice and keep the higher, so the serial limit is never understated.
        transport_readings.append(measure_transport(trained.runtime.dim, texts_file, args.duration))
        faster = partial(max, key=lambda reading: reading["texts_per_second"])
        results["transport"] = {
            kind: list(map(faster, *(t[kind] for t in transport_readings))) for kind in ("single", "batch8")
        }
        results["transport_readings"] = transport_readings
        print(f"3. all-MiniLM-L6-v2 ({minilm_dir}), served unchanged", flush=True)
        plan = Plan(MINILM_FLAGS, MINILM_CONCURRENCY, (32,), MINILM_PROTOCOL_LOADS, 100)
        results["minilm"] = measure_model(minilm, plan, texts_file, args.duration, args.provider)
        print("4. the request path alone: a model that costs nothing, served through the whole server", flush=True)
        results["request_path"] = measure_request_path(args.model_dir, texts_file, args.duration, args.provider)
    results["tokenize_one_ms"] = 1000 * measure.median_seconds(lambda: trained.tokenizer.encode([texts[0]], True), 200)
    print("5. matmul peak", flush=True)
    results["matmul_peak_flops"] = measure.matmul_peak_flops(threads)
    results["matmul_peak_kernel"] = measure.MATMUL_PEAK_KERNEL
    results["machine"] = {"date": datetime.date.today().isoformat(), "cpu": measure.cpu_name(), "cores": threads,
                          "python": platform.python_version(), "provider": trained.runtime.provider}  # fmt: skip
    if args.provider == "cuda":
        results["machine"]["gpu"] = measure.gpu_name()
    policy, defaults = trained.policy, ServerConfig()
    results["settings"] = {
        "max_batch_tokens": policy.max_batch_tokens, "default_max_batch_tokens": defaults.max_batch_tokens,
        "max_batch_size": policy.max_batch_size, "one_thread_batch_tokens": trained.runtime.one_thread_batch_tokens,
        "max_queue_tokens": policy.max_queue_tokens, "max_delay_ms": defaults.max_delay_ms,
        "texts": measure.TRAFFIC_TEXTS, "duration_per_level_s": args.duration, "protocol_rounds": PROTOCOL_ROUNDS,
    }  # fmt: skip
    results["bench_seconds"] = time.time() - started
    results["command"] = shlex.join(["python", "-m", "bench", *(sys.argv[1:] if argv is None else argv)])
    args.out.mkdir(parents=True, exist_ok=True)
    write_report(results, args.out)  # benchmarks.json first: a report that fails to render leaves the readings
    for target, measured, bar, met in targets(results):
        label = {True: "met   ", False: "MISSED", None: "NOT MEASURED"}[met]
        print(f"{label} {target}: {measured} (bar {bar})")
    print(f"wrote {args.out / 'benchmarks.md'} in {results['bench_seconds']:.0f} s")


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
