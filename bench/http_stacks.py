"""The HTTP stacks the API could be built on, compared by their own cost per request.

    .venv/bin/pip install starlette granian   # the candidates that are not dependencies
    python -m bench.http_stacks [--seconds 5] [--rounds 2] [--clients 32]

Each candidate serves the same fixed embedding (bench/protocols.py's transport-ceiling app: nothing
computed) in its own process with one worker, and the same load generator (bench/loadgen.py, HTTP, one
text per request) drives each in turn, rounds interleaved. Reports requests/s and the server process's
CPU microseconds per request. A candidate whose package is missing is skipped, and says so.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.protocols import ROOT, cpu_name, fixed_app, fixed_body, wait_listening
from loadtest.run import free_port

STACKS = {  # name: (packages it needs, how to serve)
    "uvicorn + httptools, raw ASGI (ours)": (("uvicorn", "httptools"), "uvicorn-httptools"),
    "uvicorn + h11, raw ASGI": (("uvicorn", "h11"), "uvicorn-h11"),
    "uvicorn + httptools, Starlette": (("uvicorn", "httptools", "starlette"), "uvicorn-starlette"),
    "granian (Rust HTTP), raw ASGI": (("granian",), "granian"),
}


def starlette_app(dim: int) -> Any:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    body = fixed_body(dim)

    async def embeddings(request: Request) -> Response:
        await request.body()
        return Response(body, media_type="application/json")

    return Starlette(routes=[Route("/v1/embeddings", embeddings, methods=["POST"])])


def serve(kind: str, port: int, dim: int) -> None:
    """Runs in the candidate's own process."""
    import uvicorn

    options = dict(host="127.0.0.1", port=port, lifespan="off", access_log=False, log_level="warning")
    if kind == "uvicorn-httptools":
        uvicorn.run(fixed_app(dim), http="httptools", **options)  # type: ignore[arg-type]
    elif kind == "uvicorn-h11":
        uvicorn.run(fixed_app(dim), http="h11", **options)  # type: ignore[arg-type]
    elif kind == "uvicorn-starlette":
        uvicorn.run(starlette_app(dim), http="httptools", **options)  # type: ignore[arg-type]


def start(kind: str, port: int, dim: int) -> subprocess.Popen[bytes]:
    if kind == "granian":
        app = Path(tempfile.mkdtemp()) / "fixed_granian_app.py"
        app.write_text(f"from bench.protocols import fixed_app\napp = fixed_app({dim})\n")
        command = [sys.executable, "-m", "granian", "--interface", "asgi", "--host", "127.0.0.1", "--port",
                   str(port), "--workers", "1", "--log-level", "warning", "--loop", "uvloop",
                   "--working-dir", str(app.parent), "fixed_granian_app:app"]  # fmt: skip
        return subprocess.Popen(command, cwd=ROOT, env={**os.environ, "PYTHONPATH": f"{ROOT}:{app.parent}"})
    return subprocess.Popen([sys.executable, "-m", "bench.http_stacks", "--serve", kind, "--port", str(port)], cwd=ROOT)


def serving_pid(process: subprocess.Popen[bytes]) -> int:
    """The process that answers: granian's worker is a child of the process started; the others serve in it."""
    children = Path(f"/proc/{process.pid}/task/{process.pid}/children").read_text().split()
    return int(children[0]) if children else process.pid


def load(port: int, clients: int, seconds: float, texts: Path, pid: int) -> dict[str, Any]:
    command = [sys.executable, "-m", "bench.loadgen", "--target", f"127.0.0.1:{port}", "--protocol", "http",
               "--concurrency", str(clients), "--duration", str(seconds), "--texts", str(texts),
               "--watch-pid", str(pid)]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True)
    result = dict(json.loads(done.stdout))
    result["server_cpu_us"] = sum(v for k, v in result.items() if k.startswith("server_") and k.endswith("_cpu_us"))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.port, args.dim)
        return
    present = {name: kind for name, (needs, kind) in STACKS.items() if all(importlib.util.find_spec(p) for p in needs)}
    for name in STACKS.keys() - present.keys():
        print(f"skipped (not installed): {name}")
    texts = Path(tempfile.mkdtemp()) / "texts.json"
    texts.write_text(json.dumps(["a short text about a river"]))
    readings: dict[str, list[dict[str, Any]]] = {name: [] for name in present}
    for _ in range(args.rounds):
        for name, kind in present.items():
            port = free_port()
            process = start(kind, port, args.dim)
            try:
                wait_listening(port)
                result = load(port, args.clients, args.seconds, texts, serving_pid(process))
                readings[name].append(result)
                rps, cpu = result["requests_per_second"], result["server_cpu_us"]
                print(f"  {name}: {rps:.0f} requests/s, {cpu:.0f} server CPU-us per request", flush=True)
            finally:
                process.terminate()
                process.wait(30)
    print(f"\n{cpu_name()}, {args.clients} clients, {args.rounds} rounds of {args.seconds:g} s, medians:")
    print("| stack | requests/s | server CPU-us per request |\n|---|---:|---:|")
    for name, runs in readings.items():
        rps = statistics.median(r["requests_per_second"] for r in runs)
        cpu = statistics.median(r.get("server_cpu_us", float("nan")) for r in runs)
        print(f"| {name} | {rps:.0f} | {cpu:.0f} |")


if __name__ == "__main__":
    main()
