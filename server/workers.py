"""`--workers N`: N server processes on one port (SO_REUSEPORT), supervised by a small parent.

Each worker is a full `python -m server` with its own ONNX Runtime session, `cores // N` intra-op
threads (unless --intra-op-threads says otherwise) and its own metrics port: --metrics-port + i for
worker i. The kernel spreads incoming connections across the workers. SIGTERM/SIGINT to the parent
is forwarded to every worker, each drains as a single server does, and the parent exits 0 when all
of them did. If a worker dies on its own, the parent stops the others and exits non-zero.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

from server.config import ServerConfig

log = logging.getLogger("server.workers")


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host if host not in ("0.0.0.0", "::") else "", 0))
        return int(s.getsockname()[1])


def worker_commands(config: ServerConfig, argv: Sequence[str]) -> list[list[str]]:
    port = config.port or _free_port(config.host)
    threads = config.intra_op_threads or max(1, (os.cpu_count() or 1) // config.workers)
    commands = []
    for i in range(config.workers):
        metrics_port = config.metrics_port + i if config.metrics_port > 0 else config.metrics_port
        # Later flags win in argparse, so the parent's own flags pass through unchanged.
        commands.append(
            [
                sys.executable,
                "-m",
                "server",
                *argv,
                "--workers",
                "1",
                "--reuse-port",
                "true",
                "--port",
                str(port),
                "--metrics-port",
                str(metrics_port),
                "--intra-op-threads",
                str(threads),
            ]
        )
    return commands


def run_workers(config: ServerConfig, argv: Sequence[str]) -> int:
    children = [subprocess.Popen(command) for command in worker_commands(config, argv)]
    log.info("started %d workers: pids %s", len(children), [c.pid for c in children])
    stopping = False

    def forward(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    while any(c.poll() is None for c in children):
        if not stopping and any(c.poll() is not None for c in children):
            log.error("a worker exited on its own; stopping the others")
            forward(signal.SIGTERM, None)
            stopping = True
        time.sleep(0.1)
    codes = [c.returncode for c in children]
    log.info("workers exited with %s", codes)
    return 0 if stopping and all(code == 0 for code in codes) else 1
