"""Real servers on loopback, port 0, in a background event loop; tests talk to them over sockets."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import grpc
import numpy as np
import pytest

from embedding.v1 import embedding_pb2, embedding_pb2_grpc
from server.app import EmbeddingServer, create_server
from server.config import ServerConfig


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

    def stub(self) -> embedding_pb2_grpc.EmbedderStub:
        return embedding_pb2_grpc.EmbedderStub(grpc.insecure_channel(self.target))


def server_config(model_dir: Path, **overrides: object) -> ServerConfig:
    base = ServerConfig(host="127.0.0.1", port=0, metrics_host="127.0.0.1", metrics_port=0, model_dir=str(model_dir))
    return replace(base, **overrides)


@pytest.fixture(scope="module")
def served(tiny_artifacts: Path) -> Iterator[ServerThread]:
    server = ServerThread(server_config(tiny_artifacts, max_client_batch_size=32))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def reference(tiny_artifacts: Path):  # type: ignore[no-untyped-def]
    """ONNX Runtime on one text at a time: what every served embedding must equal."""
    from server.runtime import OnnxRuntime, RuntimeOptions
    from server.tokenize import TextTokenizer

    tokenizer = TextTokenizer(tiny_artifacts / "tokenizer.json")
    runtime = OnnxRuntime(tiny_artifacts, RuntimeOptions(provider="cpu"), pad_id=0)

    def embed_alone(text: str, truncate: bool = True) -> np.ndarray:
        (row,) = tokenizer.encode([text], truncate).rows
        return runtime.run_rows([row])[0]

    return embed_alone


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
