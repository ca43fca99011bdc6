"""`--workers N`: N server processes on one port (SO_REUSEPORT), supervised by a small parent.

Each worker is a full `python -m server` with `cores // N` intra-op threads, 1/N of the memory limit and
its own metrics port (--metrics-port + i). SIGTERM/SIGINT to the parent is forwarded to every worker, each
drains as a single server does, and the parent exits 0 when all did. A worker that ends on its own is
restarted after a backoff (0.5 s doubling to 8 s); one that dies MAX_RESTARTS times within RESTART_WINDOW
seconds stops everything with exit 1; one that exits 2 refused the configuration, which no restart can
mend, and stops everything with exit 2 at once.
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
from server.memory import MIB, memory_limit

log = logging.getLogger("server.workers")


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host if host not in ("0.0.0.0", "::") else "", 0))
        return int(s.getsockname()[1])


def worker_commands(config: ServerConfig, argv: Sequence[str], memory_limit_bytes: int) -> list[list[str]]:
    port = config.port or _free_port(config.host)
    threads = config.intra_op_threads or max(1, (os.cpu_count() or 1) // config.workers)
    # The workers share the container's memory: each plans its budgets for its share, not for all of it.
    memory_share_mib = max(1, memory_limit_bytes // config.workers // MIB)
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
                "--memory-limit-mib",
                str(memory_share_mib),
            ]
        )
    return commands


MAX_RESTARTS = 5  # restarts of one worker within RESTART_WINDOW before the parent gives up
RESTART_WINDOW = 60.0
FIRST_BACKOFF = 0.5
MAX_BACKOFF = 8.0
CONFIGURATION_REFUSED = 2  # a worker's exit code when the configuration cannot run here (server/app.py main)


class Supervisor:
    """Keeps N worker processes running: restarts the ones that die, forwards SIGTERM to all."""

    def __init__(self, commands: list[list[str]]) -> None:
        self.commands = commands
        self.children: list[subprocess.Popen[bytes]] = [subprocess.Popen(c) for c in commands]
        self.started = [time.monotonic()] * len(commands)
        self.deaths: list[list[float]] = [[] for _ in commands]
        self.restart_at: list[float | None] = [None] * len(commands)
        self.stopping = False
        self.gave_up = False
        self.refused = False

    def stop(self) -> None:
        self.stopping = True
        for child in self.children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)

    def backoff(self, i: int) -> float:
        recent = len(self.deaths[i])
        return min(MAX_BACKOFF, FIRST_BACKOFF * 2 ** (recent - 1))

    def check(self) -> None:
        """One supervision round: note deaths, restart those whose backoff has passed."""
        now = time.monotonic()
        for i, child in enumerate(self.children):
            if self.restart_at[i] is not None:
                if now >= self.restart_at[i] and not self.stopping:  # type: ignore[operator]
                    self.children[i] = subprocess.Popen(self.commands[i])
                    self.started[i], self.restart_at[i] = now, None
                    log.warning("restarted worker %d: pid %d", i, self.children[i].pid)
                    if self.stopping:  # SIGTERM arrived while it started: it drains like the others
                        self.children[i].send_signal(signal.SIGTERM)
                continue
            code = child.poll()
            if code is None:
                continue
            if code == CONFIGURATION_REFUSED and not self.stopping:
                log.error("worker %d refused the configuration (exit 2, the reason above); stopping", i)
                self.refused = True
                self.stop()
                return
            if now - self.started[i] > RESTART_WINDOW:
                self.deaths[i].clear()  # it had been healthy for a while: start the backoff afresh
            self.deaths[i] = [t for t in self.deaths[i] if now - t < RESTART_WINDOW] + [now]
            if len(self.deaths[i]) > MAX_RESTARTS:
                log.error("worker %d died %d times within %.0f s; giving up", i, len(self.deaths[i]), RESTART_WINDOW)
                self.gave_up = True
                self.stop()
                return
            delay = self.backoff(i)
            log.error("worker %d (pid %d) exited with %s; restarting it in %.1f s", i, child.pid, code, delay)
            self.restart_at[i] = now + delay

    def wait(self) -> int:
        while not self.stopping:
            self.check()
            time.sleep(0.1)
        for child in self.children:
            child.wait()
        # A worker that had died and was waiting for its restart had nothing left to drain.
        codes = [c.returncode for i, c in enumerate(self.children) if self.restart_at[i] is None]
        log.info("workers exited with %s", codes)
        if self.refused:
            return CONFIGURATION_REFUSED
        # -SIGTERM: a worker still starting up when our SIGTERM came (no handler yet, nothing to drain).
        return 0 if not self.gave_up and all(code in (0, -signal.SIGTERM) for code in codes) else 1


def run_workers(config: ServerConfig, argv: Sequence[str]) -> int:
    limit, source = memory_limit(config.memory_limit_mib)
    supervisor = Supervisor(worker_commands(config, argv, limit))
    log.info("started %d workers: pids %s", len(supervisor.children), [c.pid for c in supervisor.children])
    log.info("each worker's memory limit: 1/%d of %d MiB (%s)", config.workers, limit // MIB, source)

    def forward(signum: int, _frame: object) -> None:
        supervisor.stop()

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    return supervisor.wait()
