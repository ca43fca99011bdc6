"""docs/metrics.md's table against what the server exposes: every metric, with its labels."""

from __future__ import annotations

import math
import re
import socket
from pathlib import Path

import httpx
import pytest

from tests.conftest import ServerThread, request

METRICS_DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
SUFFIX = {"counter": "_total", "info": "_info"}  # the exposed name beside the family's


def documented() -> dict[str, set[str]]:
    """Each metric the table names, with the labels it lists."""
    text = METRICS_DOC.read_text()
    table = text[text.index("| metric | type | labels | meaning |") :].split("\n\n")[0].splitlines()[2:]
    rows: dict[str, set[str]] = {}
    for line in table:
        names, _, labels, _ = (cell.strip() for cell in line.strip().strip("|").split("|", 3))
        for name in re.findall(r"`(embed_\w+)`", names):
            rows[name] = set(re.findall(r"`(\w+)`", labels))
    return rows


def exposed(served: ServerThread) -> dict[str, set[str]]:
    """Each embed_* metric the server's /metrics serves, with the labels its series carry."""
    return {
        family.name + SUFFIX.get(family.type, ""): {label for s in family.samples for label in s.labels} - {"le"}
        for family in served.server.metrics.registry.collect()
        if family.name.startswith("embed_")
    }


def test_the_metrics_reference_names_every_metric_with_its_labels(served: ServerThread) -> None:
    served.stub().Embed(request("a dog"))  # every per-request series exists once both protocols answered
    response = httpx.post(f"http://127.0.0.1:{served.server.http_port}/v1/embeddings", json={"input": "a cat"})
    assert response.status_code == 200
    assert documented() == exposed(served)


def test_a_metrics_client_that_sends_nothing_is_closed_and_scrapes_go_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """The metrics server gives each connection a thread: a silent client held one for ever."""
    from server import metrics

    assert metrics._QuietHandler.timeout == metrics.SCRAPE_READ_TIMEOUT_SECONDS < math.inf
    monkeypatch.setattr(metrics._QuietHandler, "timeout", 0.3)
    exported = metrics.Metrics()
    server, port = exported.serve("127.0.0.1", 0)
    try:
        silent = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(20)]
        for sock in silent:
            with sock:
                assert sock.recv(1) == b""  # closed by the server; with no timeout, recv fails after 10 s
        assert httpx.get(f"http://127.0.0.1:{port}/metrics").status_code == 200
    finally:
        server.shutdown()  # type: ignore[attr-defined]
