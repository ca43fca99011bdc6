"""HTTP against gRPC on one server, side by side in one run (`make bench` runs it after the gRPC benchmark).

    python -m bench.protocols --model-dir artifacts [--minilm-dir artifacts/minilm] [--seconds 5] [--rounds 2]

One `python -m server` serves both protocols; the same load generator (bench/loadgen.py, one process per
load) drives each in turn, rounds interleaved so that drift hits both alike. Besides the server, the HTTP
transport ceiling: a minimal app on the same stack (uvicorn, httptools, raw ASGI) answering a fixed
vector of the model's width. Writes docs/benchmarks-protocols.md and reports/protocols.json.
"""

from __future__ import annotations

import argparse
import base64
import datetime
import json
import platform
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from bench.measure import traffic
from contract.manifest import Manifest
from loadtest.run import free_port, local_server

ROOT = Path(__file__).resolve().parents[1]
LOADS = [(1, 32), (8, 16), (1, 1)]  # (texts per request, concurrent clients)
MINILM_LOADS = [(1, 32), (8, 16)]


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def fixed_body(dim: int) -> bytes:
    """One embedding of the model's width in OpenAI's response shape (base64), never computed."""
    vector = base64.b64encode(np.zeros(dim, dtype="<f4").tobytes()).decode()
    data = [{"object": "embedding", "index": 0, "embedding": vector}]
    return json.dumps(
        {"object": "list", "data": data, "model": "fixed", "usage": {"prompt_tokens": 1, "total_tokens": 1}}
    ).encode()


def fixed_app(dim: int) -> Any:
    """The HTTP transport ceiling's app: every POST answered with ``fixed_body``, nothing computed."""
    body = fixed_body(dim)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        more = True
        while more:
            more = (await receive()).get("more_body", False)
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return app


def wait_listening(port: int, timeout: float = 30) -> None:
    """Until something accepts connections on the port (raises if nothing does within timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


@contextmanager
def http_transport_ceiling(dim: int) -> Iterator[str]:
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "bench.protocols", "--serve-fixed", str(port), "--dim", str(dim)])
    try:
        wait_listening(port)
        yield f"127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(30)


def load(target: str, protocol: str, per_request: int, clients: int, seconds: float, texts: Path) -> dict[str, Any]:
    options = ["--concurrency", str(clients), "--duration", str(seconds), "--texts", str(texts)]
    options += ["--texts-per-request", str(per_request)]
    done = subprocess.run(
        [sys.executable, "-m", "bench.loadgen", "--target", target, "--protocol", protocol, *options],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return dict(json.loads(done.stdout))


def model_seconds(model_dir: Path, loads: list[tuple[int, int]]) -> dict[str, float]:
    """The model alone: one short text's time (median of 200 runs), and texts/s on each load's batches.

    A load of c clients sending k texts each forms batches of up to c x k texts; the raw rate runs the
    benchmark's texts in windows of that many, batched as the server's batcher batches a full queue.
    """
    from bench.measure import plan_batches
    from server.batcher import BatchPolicy
    from server.runtime import OnnxRuntime, RuntimeOptions
    from server.tokenize import TextTokenizer

    runtime = OnnxRuntime(model_dir, RuntimeOptions(), Manifest.read(model_dir).pad_id)
    tokenizer = TextTokenizer(model_dir / "tokenizer.json")
    rows = tokenizer.encode([traffic(1)[0]], truncate=True).rows
    times = []
    for _ in range(220):
        started = time.perf_counter()
        runtime.run_rows(rows)
        times.append(time.perf_counter() - started)
    out = {"one_text": statistics.median(times[20:])}
    texts = tokenizer.encode(traffic(), truncate=True).rows
    for per_request, clients in loads:
        window = per_request * clients
        batches = [b for i in range(0, len(texts), window) for b in plan_batches(texts[i : i + window], BatchPolicy())]
        runtime.run_rows(batches[0])  # warm
        started = time.perf_counter()
        for batch in batches:
            runtime.run_rows(batch)
        out[f"{per_request}x{clients}"] = len(texts) / (time.perf_counter() - started)
    return out


def measure(
    model_dir: Path, seconds: float, rounds: int, reports: Path, loads: list[tuple[int, int]]
) -> dict[str, Any]:
    """Each load over gRPC, over HTTP and (requests only) on the HTTP transport ceiling, rounds interleaved."""
    reports.mkdir(parents=True, exist_ok=True)
    texts = reports / "protocols_texts.json"
    texts.write_text(json.dumps(traffic()))
    dim = Manifest.read(model_dir).dim
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    with local_server(str(model_dir)) as server, http_transport_ceiling(dim) as ceiling:
        http_target = server.http.removeprefix("http://")
        targets = {"grpc": server.target, "http": http_target, "http ceiling": ceiling}
        for _ in range(rounds):
            for per_request, clients in loads:
                key = f"{per_request}x{clients}"
                for name, target in targets.items():
                    protocol = "grpc" if name == "grpc" else "http"
                    result = load(target, protocol, per_request, clients, seconds, texts)
                    results.setdefault(key, {}).setdefault(name, []).append(result)
                    print(f"  {key} {name}: {result['texts_per_second']:.0f} texts/s, p50 {result['p50_ms']:.2f} ms")
    return {"loads": results, "model": model_seconds(model_dir, loads)}


def median(runs: list[dict[str, Any]], field: str) -> float:
    return float(statistics.median(r[field] for r in runs))


def rates(loads: dict[str, Any], field: str) -> dict[str, dict[str, float]]:
    return {key: {name: median(runs, field) for name, runs in by.items()} for key, by in loads.items()}


def serial_limit(run: dict[str, Any], key: str) -> float:
    """Texts/s if the transport's and the model's work per text were paid one after the other on these cores:
    the ceiling's cost per request spread over its texts, plus the model's per text on this load's batches."""
    per_request = int(key.split("x")[0])
    ceiling = median(run["loads"][key]["http ceiling"], "requests_per_second") * per_request
    return 1.0 / (1.0 / ceiling + 1.0 / run["model"][key])


def report(run: dict[str, Any], command: str, minilm: dict[str, Any] | None = None) -> str:
    rate, p50 = rates(run["loads"], "texts_per_second"), rates(run["loads"], "p50_ms")
    calls = rates(run["loads"], "requests_per_second")  # the ceiling answers a fixed vector: compare requests
    model_ms = 1000 * run["model"]["one_text"]
    lines = [
        "# HTTP and gRPC, side by side",
        "",
        f"{datetime.date.today().isoformat()}, {cpu_name()} ({platform.machine()}), `{command}`. One server serves",
        "both protocols; the same load generator (`bench/loadgen.py`) drives each, rounds interleaved; medians",
        "of the rounds. The HTTP transport ceiling is a minimal app on the same stack answering a fixed vector.",
        "The serial limit L is the texts/s if the ceiling's cost per request and the model's own cost per",
        "text on this load's batches (ONNX Runtime alone) were paid one after the other on these cores.",
        "",
        "| load | gRPC texts/s | HTTP texts/s | HTTP / gRPC | HTTP ceiling requests/s | L texts/s | HTTP / L "
        "| p50 gRPC / HTTP ms |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for key in rate:
        r, limit = rate[key], serial_limit(run, key)
        lines.append(
            f"| {key.replace('x', ' text(s) x ')} clients | {r['grpc']:.0f} | {r['http']:.0f} | "
            f"{r['http'] / r['grpc']:.2f} | {calls[key]['http ceiling']:.0f} | {limit:.0f} | "
            f"{r['http'] / limit:.2f} | {p50[key]['grpc']:.2f} / {p50[key]['http']:.2f} |"
        )
    targets = [
        ("1 text x 32 clients: HTTP / L", rate["1x32"]["http"] / serial_limit(run, "1x32"), 0.8, ""),
        ("1 text x 32 clients: HTTP / gRPC", rate["1x32"]["http"] / rate["1x32"]["grpc"], 2.0, "x"),
        ("8 texts x 16 clients: HTTP / gRPC", rate["8x16"]["http"] / rate["8x16"]["grpc"], 1.0, "x"),
        ("one client: HTTP p50, ms (bar: the model's own time + 0.5 ms)", -p50["1x1"]["http"], -(model_ms + 0.5), ""),
    ]
    if minilm is not None:
        m_rate = rates(minilm["loads"], "texts_per_second")
        lines += [
            "",
            f"all-MiniLM-L6-v2 (`{minilm['model_dir']}`), the same method:",
            "",
            "| load | gRPC texts/s | HTTP texts/s | HTTP / gRPC | L texts/s | HTTP / L |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for key, r in m_rate.items():
            limit = serial_limit(minilm, key)
            lines.append(
                f"| {key.replace('x', ' text(s) x ')} clients | {r['grpc']:.0f} | {r['http']:.0f} | "
                f"{r['http'] / r['grpc']:.2f} | {limit:.0f} | {r['http'] / limit:.2f} |"
            )
        worst = min(r["http"] / r["grpc"] for r in m_rate.values())
        targets.append(("all-MiniLM-L6-v2: HTTP / gRPC, the lower of its loads", worst, 0.95, "x"))
    lines += ["", "| target | measured | bar | met |", "|---|---:|---:|---|"]
    for name, value, bar, unit in targets:
        met = "yes" if value >= bar else "**no**"
        lines.append(f"| {name} | {abs(value):.2f}{unit} | {abs(bar):.2f}{unit} | {met} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=ROOT / "artifacts")
    parser.add_argument("--minilm-dir", type=Path, help="also all-MiniLM-L6-v2's export (artifacts/minilm)")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--reports", type=Path, default=ROOT / "reports")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks-protocols.md")
    parser.add_argument("--serve-fixed", type=int, help=argparse.SUPPRESS)  # the ceiling's own process
    parser.add_argument("--dim", type=int, default=128, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_fixed:
        import uvicorn

        uvicorn.run(fixed_app(args.dim), host="127.0.0.1", port=args.serve_fixed, http="httptools",
                    lifespan="off", access_log=False, log_level="warning")  # fmt: skip
        return
    run = measure(args.model_dir, args.seconds, args.rounds, args.reports, LOADS)
    minilm = None
    if args.minilm_dir:
        minilm = measure(args.minilm_dir, args.seconds, args.rounds, args.reports, MINILM_LOADS)
        minilm["model_dir"] = str(args.minilm_dir)
    (args.reports / "protocols.json").write_text(json.dumps({"trained": run, "minilm": minilm}, indent=2))
    text = report(run, "make bench (python -m bench.protocols)", minilm)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
