"""`--workers 2`: two processes on one port, per-worker metrics, and a parent that drains them all."""

from __future__ import annotations

import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
from prometheus_client.parser import text_string_to_metric_families

from embedding.v1 import embedding_pb2_grpc
from loadtest.run import free_port, wait_serving
from tests.conftest import request

ROOT = Path(__file__).resolve().parents[2]


def ok_requests(metrics_port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
        text = r.read().decode()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "embed_requests_total" and s.labels == {"method": "Embed", "code": "OK"}:
                return s.value
    return 0.0


def test_two_workers_share_the_port_report_their_own_metrics_and_drain_on_sigterm(tiny_artifacts: Path) -> None:
    port, metrics_port = free_port(), free_port()
    while metrics_port + 1 == port:
        metrics_port = free_port()
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
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    target = f"127.0.0.1:{port}"
    try:
        wait_serving(target)
        for _ in range(24):  # separate connections: the kernel spreads connections, not calls
            with grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
                stub = embedding_pb2_grpc.EmbedderStub(channel)
                for _ in range(2):
                    assert len(stub.Embed(request("which worker am I talking to?"), timeout=10).embeddings) == 1
        per_worker = [ok_requests(metrics_port), ok_requests(metrics_port + 1)]
        assert sum(per_worker) == 48
        assert all(count > 0 for count in per_worker), per_worker  # both served (chance of not: 2**-23)
        parent.send_signal(signal.SIGTERM)
        assert parent.wait(60) == 0
        log = parent.stdout.read() if parent.stdout else ""
        assert log.count("stopped:") == 2 and "workers exited with [0, 0]" in log, log
    finally:
        if parent.poll() is None:
            parent.kill()
