"""HTTP against gRPC on one server, side by side in one run (`make bench` runs it after the gRPC benchmark).

    python -m bench.protocols --model-dir artifacts [--minilm-dir artifacts/minilm] [--seconds 5] [--rounds 2]

One `python -m server` serves both protocols; the same load generator (bench/loadgen.py, one process per
load) drives each in turn, rounds interleaved so that drift hits both alike. Besides the server, the HTTP
transport ceiling: a minimal app on the same stack (bench/transport.py --protocol http) answering a
fixed vector of the model's width. Writes docs/benchmarks-protocols.md and reports/protocols.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

from bench.measure import cpu_name, load_sweep, plan_batches, traffic, transport_server
from contract.manifest import Manifest
from loadtest.run import local_server
from server.batcher import BatchPolicy
from server.runtime import OnnxRuntime, RuntimeOptions
from server.tokenize import TextTokenizer

ROOT = Path(__file__).resolve().parents[1]
LOADS = [(1, 32), (8, 16), (1, 1)]  # (texts per request, concurrent clients)
MINILM_LOADS = [(1, 32), (8, 16)]


def model_seconds(model_dir: Path, loads: list[tuple[int, int]]) -> dict[str, float]:
    """The model alone: one short text's time (median of 200 runs), and texts/s on each load's batches.

    A load of c clients sending k texts each forms batches of up to c x k texts; the raw rate runs the
    benchmark's texts in windows of that many, batched as the server's batcher batches a full queue.
    """
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
    with local_server(str(model_dir)) as server, transport_server(dim, "http") as ceiling:
        http_target = server.http.removeprefix("http://")
        targets = {"grpc": server.target, "http": http_target, "http ceiling": ceiling.address}
        for _ in range(rounds):
            for per_request, clients in loads:
                key = f"{per_request}x{clients}"
                for name, target in targets.items():
                    protocol = "grpc" if name == "grpc" else "http"
                    print(f"{key} {name}", flush=True)
                    result = load_sweep(target, (clients,), texts, seconds, per_request, protocol=protocol)[0]
                    results.setdefault(key, {}).setdefault(name, []).append(result)
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
    args = parser.parse_args()
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
