"""Shared fixtures: one tiny model trained for a few steps on a slice of WordNet and exported, per run."""

from __future__ import annotations

import asyncio
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path

import grpc
import numpy as np
import pytest

from embedding.v1 import embedding_pb2, embedding_pb2_grpc
from server.api.grpc import Received
from server.app import EmbeddingServer, create_server
from server.config import ServerConfig
from server.core.admission import Ticket

ROOT = Path(__file__).resolve().parents[1]
# A line of the server's log: time, level, logger (every line it writes, gRPC's and uvicorn's included).
LOG_LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (INFO|WARNING|ERROR|CRITICAL) [\w.]+: ")

# Servers the tests start as processes (`python -m server`) take any free HTTP port, never 8080.
os.environ.setdefault("EMBED_HTTP_PORT", "0")
os.environ.setdefault("EMBED_HTTP_HOST", "127.0.0.1")

TINY_MODEL = dict(vocab_size=1000, max_len=32, d_model=32, n_heads=2, n_layers=2, d_ff=64, dropout=0.1)


def tiny_train_config(**overrides: object):  # type: ignore[no-untyped-def]
    """A training run of seconds: a slice of WordNet, the tiny model, a few steps."""
    from model.train import TrainConfig
    from model.transformer import EncoderConfig

    base = dict(steps=3, batch_size=16, vocab_size=300, max_synsets=600, held_out_fraction=0.1, matryoshka_dims=(16,))
    return replace(TrainConfig(progress=False), model=EncoderConfig(**TINY_MODEL), **{**base, **overrides})


@pytest.fixture(scope="session")
def tiny_training(tmp_path_factory: pytest.TempPathFactory):
    from model.checkpoint import save_checkpoint
    from model.train import train

    config = tiny_train_config(steps=12, batch_size=32, vocab_size=1000, max_synsets=3000, held_out_fraction=0.05)
    result = train(config)
    out = tmp_path_factory.mktemp("tiny")
    save_checkpoint(result.model, result.tokenizer, result.summary, out)
    return result, out


@pytest.fixture(scope="session")
def tiny_artifacts(tiny_training) -> Path:
    """A model directory with every serving artifact, produced by the real export path."""
    from export.artifacts import export_all

    _, out = tiny_training
    _, report = export_all(out)
    assert report.passes(), report.table()
    return out


class ServerThread:
    """Runs one EmbeddingServer on its own event loop thread."""

    def __init__(self, config: ServerConfig, load: bool = True) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server: EmbeddingServer
        self.server, self.port = self.call(create_server(config, load=load))
        self.target = f"127.0.0.1:{self.port}"

    def call(self, coro, timeout: float = 60):  # type: ignore[no-untyped-def]
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self, grace: float = 1.0) -> None:
        self.call(self.server.stop(grace))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        assert not self.thread.is_alive(), "the server's event loop did not stop"

    def stub(self) -> embedding_pb2_grpc.EmbedderStub:
        return embedding_pb2_grpc.EmbedderStub(grpc.insecure_channel(self.target))

    def settled(self) -> None:
        """Waits until no request is in progress, read on the server's own loop. A client has its answer a moment
        before the server counts it, so a test reading counters of a shared server waits for this first."""

        async def idle() -> bool:
            return self.server.state.in_flight == 0

        eventually(lambda: self.call(idle()), what="no request in progress")


@pytest.fixture
def finalised_while_held(monkeypatch: pytest.MonkeyPatch) -> list[Ticket]:
    """Admission tickets freed while still held: given back by their finaliser, not by the path that took them
    (with the garbage collector off, such a ticket can stay held as long as its reference cycle lives)."""
    found: list[Ticket] = []
    finalize = Ticket.__del__

    def finalized(ticket: Ticket) -> None:
        if ticket._give_back is not None:
            found.append(ticket)
        finalize(ticket)

    monkeypatch.setattr(Ticket, "__del__", finalized)
    return found


class GatedBackend:
    """Wraps a running server's backend: batches wait until `release()`, and every batch is recorded.

    Lets a test hold the backend busy so a queue builds up, and prove which inputs were computed.
    """

    def __init__(self, server: EmbeddingServer, model: str = "") -> None:
        batcher = server.state.resolve(model).batcher  # "" = the default model
        self._batcher = batcher
        self._open = threading.Event()
        self.held = 0  # batches that reached the backend (and wait there until release)
        self.batch_sizes: list[int] = []
        self.row_lengths: list[int] = []
        self._real = batcher.swap_backend(self)  # last: a batch may call it at once

    def __call__(self, rows):  # type: ignore[no-untyped-def]
        self.held += 1
        if not self._open.wait(30):
            raise AssertionError("the test never released the gated backend")
        self.batch_sizes.append(len(rows))
        self.row_lengths.extend(len(r) for r in rows)
        return self._real(rows)

    def release(self) -> None:
        self._open.set()

    def remove(self) -> None:
        self.release()
        self._batcher.swap_backend(self._real)


def serve_exits(args: list[str], env: dict[str, str]) -> tuple[int, str]:
    """`python -m server` run as an operator would, for settings or models it must refuse before it serves:
    its exit code and everything it printed."""
    ports = ["--port", "0", "--http-port", "0", "--metrics-port", "-1"]
    done = subprocess.run(
        [sys.executable, "-m", "server", *ports, "--model-dir", "/nonexistent", *args],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    return done.returncode, done.stdout + done.stderr


# An x-request-id the server made (server/request_ids.py): req_ and 32 hex digits.
GENERATED_ID = re.compile(r"req_[0-9a-f]{32}")


def eventually(predicate, timeout: float = 10, what: str = "") -> None:  # type: ignore[no-untyped-def]
    """Wait until predicate() is true; fail the test (never pass silently) if it is not within timeout."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what or predicate}")
        time.sleep(0.02)


def counter(metric, *labels: str) -> float:  # type: ignore[no-untyped-def]
    """A prometheus_client counter summed over its series whose first label values are ``labels``.

    The ``protocol`` label, when there is one, is skipped (every protocol counts); the ``model`` label
    comes last, so leaving it out sums over every model.
    """
    names = [name for name in metric._labelnames if name != "protocol"]
    wanted = dict(zip(names, labels, strict=False))
    return sum(
        s.value
        for family in metric.collect()
        for s in family.samples
        if s.name.endswith("_total") and all(s.labels.get(k) == v for k, v in wanted.items())
    )


def requests_by_code(metrics) -> dict[tuple[str, str], float]:  # type: ignore[no-untyped-def]
    """embed_requests_total as {(method, code): count} over every model, zero series left out."""
    totals: dict[tuple[str, str], float] = {}
    for family in metrics.requests.collect():
        for s in family.samples:
            if s.name == "embed_requests_total" and s.value:
                key = (s.labels["method"], s.labels["code"])
                totals[key] = totals.get(key, 0.0) + s.value
    return totals


def read_response(sock: socket.socket) -> str:
    """One whole HTTP response: the head, then as many body bytes as its Content-Length says."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed mid-head: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
    )
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "connection closed mid-body"
        body += chunk
    return (head + b"\r\n\r\n" + body).decode()


def server_config(model_dir: Path, **overrides: object) -> ServerConfig:
    base = ServerConfig(
        host="127.0.0.1",
        port=0,
        metrics_host="127.0.0.1",
        metrics_port=0,
        http_host="127.0.0.1",
        http_port=0,
        model_dir=str(model_dir),
        # No pause on stop for load balancers that tests do not have; the drain tests set their own.
        drain_delay_seconds=0.0,
    )
    return replace(base, **overrides)


@pytest.fixture(scope="module")
def served(tiny_artifacts: Path) -> Iterator[ServerThread]:
    server = ServerThread(server_config(tiny_artifacts, max_client_batch_size=32))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def reference(tiny_artifacts: Path):  # type: ignore[no-untyped-def]
    """ONNX Runtime on one text at a time: what every served embedding must equal."""
    from server.backend.ort import OnnxRuntime, RuntimeOptions
    from server.core.tokenizer import TextTokenizer

    tokenizer = TextTokenizer(tiny_artifacts / "tokenizer.json")
    runtime = OnnxRuntime(tiny_artifacts, RuntimeOptions(provider="cpu"), pad_id=0)

    def embed_alone(text: str, truncate: bool = True) -> np.ndarray:
        (row,) = tokenizer.encode([text], truncate).rows
        return runtime.run_rows([row])[0]

    return embed_alone


class PeerAtStartOnly:
    """A servicer context whose peer() answers only until the handler first reads from the RPC. From then
    on the RPC may end at any moment (a cancelled stream's requests still run on tasks of their own), and
    gRPC's peer() calls into its core on the call: a worker running such a task died in it with SIGSEGV."""

    def __init__(self, *messages: object) -> None:
        self.messages = [Received(m) for m in messages]
        self.read_from = False

    def peer(self) -> str:
        assert not self.read_from, "peer() read after the handler awaited the RPC"
        return "ipv4:127.0.0.1:40000"

    async def read(self) -> Received | object:
        self.read_from = True
        return self.messages.pop(0) if self.messages else grpc.aio.EOF

    async def stream(self) -> AsyncIterator[Received]:
        while (message := await self.read()) is not grpc.aio.EOF:
            yield message  # type: ignore[misc]

    def time_remaining(self) -> None:
        return None

    def invocation_metadata(self) -> tuple[()]:
        return ()

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: object = ()) -> None:
        raise AssertionError(f"{code.name}: {details}")


def request(*texts: str, truncate: bool = False, normalize: bool | None = None) -> embedding_pb2.EmbedRequest:
    r = embedding_pb2.EmbedRequest(inputs=list(texts), truncate=truncate)
    if normalize is not None:
        r.normalize = normalize
    return r


SENTENCES = [
    "the cat sat on the mat",
    "a dog",
    "an estuary in central northeastern England formed by the Ouse River and the Trent River",
    "draw air into, and expel out of, the lungs",
    "I can breathe better when the air is clean",
    "x",
    "the act of someone who picks up or takes something",
    "move fast",
]


@pytest.fixture(scope="session")
def tiny_bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random sentence-transformers BERT folder (tests/tiny_bert.py)."""
    from tests.tiny_bert import write_tiny_bert

    return write_tiny_bert(tmp_path_factory.mktemp("tiny-bert"))


@pytest.fixture(scope="session")
def tiny_bert_artifacts(tiny_bert: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny BERT through `export.pretrained`: every serving artifact, named test/tiny-bert."""
    from export.pretrained import export_pretrained

    out = tmp_path_factory.mktemp("tiny-bert-artifacts")
    export_pretrained(tiny_bert, out, model_id="test/tiny-bert")
    return out
