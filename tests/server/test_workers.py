"""`--workers 2`: two processes on one port, per-worker metrics, and a parent that drains them all."""

from __future__ import annotations

import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
from prometheus_client.parser import text_string_to_metric_families

from embedding.v1 import embedding_pb2_grpc
from loadtest.run import wait_serving, wait_workers_loaded
from server.memory import MIB, memory_limit
from tests.conftest import eventually, request

ROOT = Path(__file__).resolve().parents[2]


def fixed_ports() -> tuple[int, int]:
    """A gRPC port and a metrics port whose next port is free too (worker i serves metrics on port + i).

    Workers need fixed ports, picked before they start. Below the kernel's ephemeral range: a port
    from bind(0) could be handed to another test's bind(0) meanwhile, and metrics port + 1 has the
    parity Linux gives outgoing connections, so any client socket of a parallel test could hold it.
    """
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    while True:
        base = random.randrange(10_000, low - 3)
        try:
            for port in (base, base + 1, base + 2):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base, base + 1


def kill_all(parent: subprocess.Popen) -> None:  # type: ignore[type-arg]
    """A failed test's server: the parent and its workers (its process group, started with start_new_session)."""
    if parent.poll() is None:
        os.killpg(parent.pid, signal.SIGKILL)


def samples(metrics_port: int) -> list:  # type: ignore[type-arg]
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def ok_requests(metrics_port: int) -> float:
    return sum(
        s.value
        for s in samples(metrics_port)
        if s.name == "embed_requests_total" and s.labels["method"] == "Embed" and s.labels["code"] == "OK"
    )


def test_two_workers_share_the_port_report_their_own_metrics_and_drain_on_sigterm(tiny_artifacts: Path) -> None:
    port, metrics_port = fixed_ports()
    parent = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "server",
            "--workers",
            "2",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--metrics-host",
            "127.0.0.1",
            "--metrics-port",
            str(metrics_port),
            "--model-dir",
            str(tiny_artifacts),
            "--http-port",
            "-1",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # a failed check kills the workers with the parent (their group)
    )
    target = f"127.0.0.1:{port}"
    try:
        # One worker SERVING is enough for wait_serving; a connection to the other while it still loads
        # would be answered UNAVAILABLE (as it should), so this waits for both.
        wait_workers_loaded(metrics_port, 2, timeout=60)
        wait_serving(target, process=parent)
        for _ in range(24):  # separate connections: the kernel spreads connections, not calls
            with grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
                stub = embedding_pb2_grpc.EmbedderStub(channel)
                for _ in range(2):
                    assert len(stub.Embed(request("which worker am I talking to?"), timeout=10).embeddings) == 1
        per_worker = [ok_requests(metrics_port), ok_requests(metrics_port + 1)]
        assert sum(per_worker) == 48
        assert all(count > 0 for count in per_worker), per_worker  # both served (chance of not: 2**-23)
        limit = memory_limit(0)[0]  # the machine's or the container's memory
        share = limit // 2 // MIB * MIB
        for worker_metrics in (metrics_port, metrics_port + 1):
            limits = [s.value for s in samples(worker_metrics) if s.name == "embed_memory_limit_bytes"]
            assert limits == [share]  # each worker plans its budgets for its half, not for all of it
        parent.send_signal(signal.SIGTERM)
        assert parent.wait(60) == 0
        log = parent.stdout.read() if parent.stdout else ""
        assert log.count("stopped:") == 2 and "workers exited with [0, 0]" in log, log
        assert f"each worker's memory limit: 1/2 of {limit // MIB} MiB" in log, log
    finally:
        if parent.poll() is None:
            kill_all(parent)  # the workers too: they hold the log's pipe open
            print(parent.communicate(timeout=30)[0])  # the workers' log, shown by pytest when the test failed


def worker_pids(log_path: Path) -> dict[int, int]:
    """Worker index -> its current pid, from the parent's log."""
    text = log_path.read_text()
    pids: dict[int, int] = {}
    started = re.search(r"started \d+ workers: pids \[([\d, ]+)\]", text)
    if started:
        pids = dict(enumerate(int(p) for p in started.group(1).split(",")))
    for index, pid in re.findall(r"restarted worker (\d+): pid (\d+)", text):
        pids[int(index)] = int(pid)
    return pids


def test_a_killed_worker_is_restarted_while_the_other_serves_on_without_a_failure(
    tiny_artifacts: Path, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    port, metrics_port = fixed_ports()
    log_path = tmp_path / "parent.log"
    with log_path.open("w") as log_file:
        parent = subprocess.Popen(
            [
                *(sys.executable, "-m", "server", "--workers", "2", "--host", "127.0.0.1", "--port", str(port)),
                *("--metrics-host", "127.0.0.1", "--metrics-port", str(metrics_port)),
                *("--model-dir", str(tiny_artifacts), "--drain-delay-seconds", "0.2", "--http-port", "-1"),
            ],
            cwd=ROOT,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a failed check kills the workers with the parent (their group)
        )
    target = f"127.0.0.1:{port}"
    channels: list[grpc.Channel] = []
    threads: list[threading.Thread] = []
    stop = threading.Event()
    try:
        wait_serving(target, process=parent)
        eventually(lambda: len(worker_pids(log_path)) == 2, what="both worker pids logged")
        wait_workers_loaded(metrics_port, 2, timeout=60)  # one worker serving does not mean both are
        first_pids = worker_pids(log_path)

        def served_by(channel: grpc.Channel) -> int:
            """Which worker holds this channel's connection: the one whose OK counter moves."""
            before = [ok_requests(metrics_port), ok_requests(metrics_port + 1)]
            embedding_pb2_grpc.EmbedderStub(channel).Embed(request("who serves me?"), timeout=10)
            after = [ok_requests(metrics_port), ok_requests(metrics_port + 1)]
            (worker,) = [i for i in range(2) if after[i] > before[i]]
            return worker

        owner: dict[int, int] = {}
        while len(set(owner.values())) < 2 or len(owner) < 8:
            assert len(channels) < 60, "the kernel never spread connections over both workers"
            channel = grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
            channels.append(channel)
            owner[len(channels) - 1] = served_by(channel)
        failures: dict[int, list[str]] = {i: [] for i in owner}
        answered: dict[int, int] = dict.fromkeys(owner, 0)

        def load(i: int) -> None:
            stub = embedding_pb2_grpc.EmbedderStub(channels[i])
            while not stop.is_set():
                try:
                    stub.Embed(request(f"steady load on channel {i}"), timeout=10)
                    answered[i] += 1
                except grpc.RpcError as e:
                    failures[i].append(e.code().name)
                time.sleep(0.005)

        threads = [threading.Thread(target=load, args=(i,)) for i in owner]
        for t in threads:
            t.start()
        eventually(lambda: all(n >= 10 for n in answered.values()), 10, "steady load on every connection")
        killed_at = time.monotonic()
        os.kill(first_pids[0], signal.SIGKILL)
        # Within 10 s the port serves with two workers again: worker 0 has a new pid and answers.
        eventually(lambda: worker_pids(log_path).get(0, first_pids[0]) != first_pids[0], 10, "worker 0 restarted")

        def worker_0_serves() -> bool:
            """A fresh connection (the kernel picks a worker per connection) reaches the new worker 0."""
            with grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)]) as fresh:
                try:
                    embedding_pb2_grpc.EmbedderStub(fresh).Embed(request("a new connection"), timeout=5)
                    return ok_requests(metrics_port) > 0
                except (grpc.RpcError, OSError):
                    return False

        eventually(worker_0_serves, 10 - (time.monotonic() - killed_at), "the new worker 0 answering")
        back_after = time.monotonic() - killed_at
        after_restart = dict(answered)  # the survivors go on answering after the restart too
        eventually(lambda: all(answered[i] >= after_restart[i] + 10 for i in after_restart if owner[i] == 1), 10,
                   "the surviving worker still answering")  # fmt: skip
        stop.set()
        for t in threads:
            t.join(20)
            assert not t.is_alive(), "a load thread is stuck"
        survivors = [i for i, worker in owner.items() if worker == 1]
        assert survivors and all(answered[i] > 10 for i in survivors), answered
        assert all(failures[i] == [] for i in survivors), {i: failures[i] for i in survivors}
        print(
            f"\nworkers: SIGKILL worker 0; two workers serving again after {back_after:.1f} s; the surviving "
            f"worker's {len(survivors)} connections answered {sum(answered[i] for i in survivors)} calls, 0 failed"
        )
        assert parent.poll() is None  # the parent never gave up

        # A worker that drains and exits 0 on its own is restarted too: the parent does not exit 0.
        os.kill(worker_pids(log_path)[1], signal.SIGTERM)
        eventually(lambda: worker_pids(log_path)[1] != first_pids[1], 15, "worker 1 restarted after exiting 0")
        assert parent.poll() is None

        def worker_1_up() -> bool:
            try:
                return ok_requests(metrics_port + 1) == 0  # a fresh process: its counters start at 0
            except OSError:
                return False

        eventually(worker_1_up, 15, "the new worker 1 up")
        parent.send_signal(signal.SIGTERM)
        assert parent.wait(60) == 0
        assert "workers exited with [0, 0]" in log_path.read_text()
    finally:
        stop.set()
        for t in threads:
            t.join(20)
        for channel in channels:
            channel.close()
        kill_all(parent)
        print(log_path.read_text())  # the workers' log, shown by pytest when the test failed


def test_workers_that_refuse_the_configuration_stop_the_parent_with_exit_2_at_once(tmp_path: Path) -> None:
    """Missing artifacts: each worker exits 2 with the reason; restarting cannot mend that, so the parent
    stops at once with exit 2 instead of restarting them MAX_RESTARTS times."""
    done = subprocess.run(
        [sys.executable, "-m", "server", "--workers", "2", "--port", "0", "--http-port", "0", "--metrics-port", "-1",
         "--model-dir", str(tmp_path / "missing")],
        cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    assert "refused the configuration" in done.stderr and "not found" in done.stderr, done.stderr[-2000:]
    assert "restarted worker" not in done.stderr, done.stderr[-2000:]
