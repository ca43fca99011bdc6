"""`make loadtest`: headless Locust against EMBED_TARGET, or against a server it starts and stops.

    python -m loadtest.run [--users 32] [--spawn-rate 8] [--duration 30s] [--reports reports]

Writes Locust's CSV (reports/loadtest_*.csv) and HTML (reports/loadtest.html) reports, plus the final per-task
figures and the run's length (reports/loadtest_summary.json), and exits non-zero when any request failed.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerExited(RuntimeError):
    def __init__(self, code: int) -> None:
        super().__init__(f"the server exited with code {code} before it served")
        self.code = code


def listens_on(pid: int, port: int) -> bool:
    """Whether the process, or one of its children (--workers), holds a TCP socket listening on the port."""
    import psutil

    try:
        process = psutil.Process(pid)
        family = [process, *process.children(recursive=True)]
    except psutil.NoSuchProcess:
        return False
    for member in family:
        try:
            if any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in member.net_connections("tcp")):
                return True
        except psutil.NoSuchProcess:
            pass
    return False


def wait_listening(process: subprocess.Popen[Any], port: int, timeout: float = 30) -> None:
    """Until the process itself listens on the port; ServerExited as soon as it exits."""
    deadline = time.monotonic() + timeout
    while not listens_on(process.pid, port):
        if process.poll() is not None:
            raise ServerExited(process.returncode)
        if time.monotonic() > deadline:
            raise TimeoutError(f"process {process.pid} not listening on {port} within {timeout:.0f} s")
        time.sleep(0.1)


def wait_serving(target: str, timeout: float = 60, process: subprocess.Popen[Any] | None = None) -> None:
    """Until the target's health says SERVING. Given the process that should serve it: until that process
    itself listens there (another process may have taken the port after free_port chose it, and answer in
    its place), and ServerExited as soon as it exits."""
    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(target))
    port = int(target.rsplit(":", 1)[1])
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if process is not None and process.poll() is not None:
            raise ServerExited(process.returncode)
        try:
            status = stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status
            if status == health_pb2.HealthCheckResponse.SERVING and (process is None or listens_on(process.pid, port)):
                return
        except grpc.RpcError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{target} did not become SERVING within {timeout:.0f} s")


def wait_workers_loaded(metrics_port: int, workers: int, timeout: float = 120) -> None:
    """Until every `--workers` process has loaded its models (worker i's metrics, on metrics_port + i, list them):
    wait_serving returns at the first SERVING answer, and a connection the kernel hands to a worker still
    loading is refused (UNAVAILABLE)."""
    end = time.monotonic() + timeout
    waiting = set(range(workers))
    while waiting and time.monotonic() < end:
        for i in sorted(waiting):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port + i}/metrics", timeout=1) as answer:
                    if b"embed_model_info{" in answer.read():
                        waiting.discard(i)
            except OSError:
                pass
        time.sleep(0.2)
    if waiting:
        raise TimeoutError(f"workers {sorted(waiting)} not ready within {timeout:.0f} s")


@dataclass(frozen=True)
class LocalServer:
    target: str  # gRPC host:port
    process: subprocess.Popen[bytes]
    http: str  # the HTTP API's base URL


# A server exits 2 when it cannot listen: here, a port another process took between free_port and the bind.
PORT_ATTEMPTS = 3


@contextmanager
def local_server(model_dir: str, extra: Sequence[str] = (), source: Path = ROOT) -> Iterator[LocalServer]:
    """`python -m server` (from ``source``, a checkout) on free loopback ports, stopped with SIGTERM afterwards."""
    for attempt in range(1, PORT_ATTEMPTS + 1):
        port, http_port = free_port(), free_port()
        ports = ["--host", "127.0.0.1", "--port", str(port), "--metrics-port", "-1"]
        ports += ["--http-host", "127.0.0.1", "--http-port", str(http_port)]
        model = ["--model-dir", str(Path(model_dir).resolve())]
        command = [sys.executable, "-m", "server", *ports, *model, "--log-level", "WARNING", *extra]
        process = subprocess.Popen(command, cwd=source)
        try:
            wait_serving(f"127.0.0.1:{port}", process=process)
            break
        except ServerExited as e:
            if e.code != 2 or attempt == PORT_ATTEMPTS:
                raise
        except BaseException:
            process.terminate()
            process.wait(30)
            raise
    try:
        yield LocalServer(f"127.0.0.1:{port}", process, f"http://127.0.0.1:{http_port}")
    finally:
        process.terminate()
        process.wait(30)


def totals(reports: Path) -> tuple[int, int, float]:
    """Requests, failures, and seconds from the start to the last request."""
    summary = json.loads((reports / "loadtest_summary.json").read_text())
    return summary["total"]["requests"], summary["total"]["failures"], summary["seconds"]


USERS = {"grpc": ["EmbeddingUser"], "http": ["HttpEmbeddingUser"], "both": ["EmbeddingUser", "HttpEmbeddingUser"]}


def run_locust(
    target: str,
    users: int,
    spawn_rate: float,
    duration: str,
    reports: Path,
    model_infer: bool = False,
    protocol: str = "grpc",
    http_target: str = "",
    locustfile: Path = ROOT / "loadtest" / "locustfile.py",
) -> int:
    reports.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "locust",
        *USERS[protocol],  # before any option: --exclude-tags would take them as tags
        "-f",
        str(locustfile),
        "--headless",
        "--host",
        target,
        "--users",
        str(users),
        "--spawn-rate",
        str(spawn_rate),
        "--run-time",
        duration,
        "--csv",
        str(reports / "loadtest"),
        "--html",
        str(reports / "loadtest.html"),
        "--only-summary",
        "--stop-timeout",
        "10",
    ]
    if not model_infer:  # the Open Inference Protocol task is optional: --model-infer turns it on
        command += ["--exclude-tags", "model-infer"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LOADTEST_SUMMARY": str(reports / "loadtest_summary.json")}
    if http_target:
        env["EMBED_HTTP_TARGET"] = http_target
    return subprocess.run(command, cwd=ROOT, env=env).returncode


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=os.environ.get("EMBED_TARGET", ""), help="host:port; empty = start one")
    parser.add_argument("--model-dir", default=os.environ.get("EMBED_MODEL_DIR", "artifacts"))
    parser.add_argument("--users", type=int, default=32)
    parser.add_argument("--spawn-rate", type=float, default=8)
    parser.add_argument("--duration", default="30s")
    parser.add_argument("--reports", type=Path, default=ROOT / "reports")
    parser.add_argument(
        "--model-infer",
        action="store_true",
        default=os.environ.get("LOADTEST_MODEL_INFER", "") not in ("", "0", "false"),
        help="also run the Open Inference Protocol task (ModelInfer, 4 texts; env LOADTEST_MODEL_INFER=1)",
    )
    parser.add_argument(
        "--protocol",
        choices=sorted(USERS),
        default=os.environ.get("LOADTEST_PROTOCOL", "grpc"),
        help="grpc (Embed, EmbedStream, ModelInfer), http (/v1/embeddings) or both (env LOADTEST_PROTOCOL)",
    )
    parser.add_argument(
        "--http-target", default=os.environ.get("EMBED_HTTP_TARGET", ""), help="http://host:port of the HTTP API"
    )
    args = parser.parse_args(argv)
    locust = (args.users, args.spawn_rate, args.duration, args.reports, args.model_infer, args.protocol)
    if args.target:
        code = run_locust(args.target, *locust, args.http_target)
    else:
        try:
            with local_server(args.model_dir) as server:
                code = run_locust(server.target, *locust, server.http)
        except ServerExited as e:  # the server's own log, above, says why
            print(f"loadtest: {e} (its log above says why); no load was run", file=sys.stderr)
            return e.code or 1
    requests, failures, seconds = totals(args.reports)
    print(f"loadtest: {requests} requests in {seconds:.1f} s, {failures} failed; reports in {args.reports}")
    if requests == 0:
        return 1
    return 1 if failures else code


if __name__ == "__main__":
    sys.exit(main())
