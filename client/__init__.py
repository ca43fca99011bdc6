"""A small typed client for the embedding service (sync and asyncio) and a CLI.

python -m client embed "some text" "more text"   # prints JSON
python -m client info
python -m client health
python -m client --target host:50051 embed --no-normalize --truncate "..."
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from embedding.v1 import embedding_pb2, embedding_pb2_grpc

REQUEST_ID = "x-request-id"  # the header a failed call's trailing metadata names it in

DEFAULT_TARGET = "localhost:50051"


@dataclass(frozen=True)
class EmbedResult:
    embeddings: list[list[float]]
    token_counts: list[int]
    truncated_inputs: list[int]
    timings: dict[str, float]
    model: str  # the served model that computed them
    dimensions_trained: bool | None = None  # asked for dimensions: whether the model was trained at that length


def make_request(
    texts: Sequence[str], truncate: bool = False, normalize: bool = True, model: str = "", dimensions: int | None = None
) -> embedding_pb2.EmbedRequest:
    """model "" asks for the server's default model; dimensions keeps the first d components (None: all)."""
    request = embedding_pb2.EmbedRequest(inputs=list(texts), truncate=truncate, normalize=normalize, model=model)
    if dimensions is not None:
        request.dimensions = dimensions
    return request


def from_response(response: embedding_pb2.EmbedResponse) -> EmbedResult:
    t = response.timings
    return EmbedResult(
        embeddings=[list(e.values) for e in response.embeddings],
        token_counts=list(response.token_counts),
        truncated_inputs=list(response.truncated_inputs),
        timings={
            "tokenization_seconds": t.tokenization_seconds,
            "queue_seconds": t.queue_seconds,
            "inference_seconds": t.inference_seconds,
            "total_seconds": t.total_seconds,
        },
        model=response.model,
        dimensions_trained=response.dimensions_trained if response.HasField("dimensions_trained") else None,
    )


def joined(results: Sequence[EmbedResult], split: Sequence[tuple[int, list[str]]]) -> EmbedResult:
    """The results of the parts ``split`` made of one list (each part's start and texts), as the list's one result."""
    if len(results) == 1:
        return results[0]
    starts = [start for start, _ in split]
    return EmbedResult(
        embeddings=[e for r in results for e in r.embeddings],
        token_counts=[c for r in results for c in r.token_counts],
        truncated_inputs=[start + i for r, start in zip(results, starts, strict=True) for i in r.truncated_inputs],
        timings={name: sum(r.timings[name] for r in results) for name in results[0].timings},  # one after another
        model=results[0].model,
        dimensions_trained=results[0].dimensions_trained,
    )


def text_list(texts: str | Sequence[str]) -> list[str]:
    """The texts to embed: one string is one text (a str is also a Sequence[str], of its characters)."""
    return [texts] if isinstance(texts, str) else list(texts)


def parts(texts: list[str], most: int | None) -> list[tuple[int, list[str]]]:
    """A list as consecutive requests of at most ``most`` texts, each with where it starts (one request, as
    it is, when it fits or the limit is not known)."""
    if most is None or len(texts) <= most:
        return [(0, texts)]
    return [(start, texts[start : start + most]) for start in range(0, len(texts), most)]


def plain(message: Any) -> dict[str, object]:
    """Every field of a message, defaults included, as plain Python values: JSON-ready. (json_format's
    MessageToDict would turn the uint64 byte counts into strings.)"""

    def value(field: Any, v: Any) -> object:
        return plain(v) if field.message_type else v

    return {
        f.name: [value(f, v) for v in getattr(message, f.name)] if f.is_repeated
        else value(f, getattr(message, f.name))
        for f in message.DESCRIPTOR.fields
    }  # fmt: skip


@dataclass(frozen=True)
class Security:
    """How to reach a server started with TLS, mutual TLS and/or a bearer token (all optional)."""

    tls_ca: str = ""  # PEM CA that signed the server's certificate; set = use TLS
    tls_cert: str = ""  # client certificate, for mutual TLS
    tls_key: str = ""  # its key
    token: str = ""  # bearer token

    def credentials(self) -> grpc.ChannelCredentials | None:
        if not (self.tls_ca or self.tls_cert):
            return None

        def read(path: str) -> bytes | None:
            return Path(path).read_bytes() if path else None

        return grpc.ssl_channel_credentials(read(self.tls_ca), read(self.tls_key), read(self.tls_cert))

    def metadata(self) -> list[tuple[str, str]]:
        return [("authorization", f"Bearer {self.token}")] if self.token else []


def _channel(target: str, security: Security, aio: bool) -> Any:
    credentials = security.credentials()
    if aio:
        return grpc.aio.secure_channel(target, credentials) if credentials else grpc.aio.insecure_channel(target)
    return grpc.secure_channel(target, credentials) if credentials else grpc.insecure_channel(target)


class EmbeddingClient:
    """Blocking client. Errors surface as grpc.RpcError with the server's status code and message."""

    def __init__(
        self, target: str = DEFAULT_TARGET, timeout: float | None = 30.0, security: Security = Security()
    ) -> None:
        self.channel = _channel(target, security, aio=False)
        self.stub = embedding_pb2_grpc.EmbedderStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)
        self.timeout = timeout
        self.metadata = security.metadata()
        self._max_inputs: int | None = None  # the server's inputs per request, once asked

    def embed(
        self,
        texts: str | Sequence[str],
        truncate: bool = False,
        normalize: bool = True,
        model: str = "",
        dimensions: int | None = None,
    ) -> EmbedResult:
        """Any number of texts: a list longer than the server takes in one request (its Info's
        ``max_client_batch_size``, asked once, on the first list of more than one text) goes as consecutive
        requests of that size. One string is one text."""
        texts = text_list(texts)
        if len(texts) > 1 and self._max_inputs is None:
            self._max_inputs = int(self.info()["max_client_batch_size"])  # type: ignore[call-overload]
        split = parts(texts, self._max_inputs)
        results = [
            from_response(self.stub.Embed(make_request(part, truncate, normalize, model, dimensions),
                                          timeout=self.timeout, metadata=self.metadata))
            for _, part in split
        ]  # fmt: skip
        return joined(results, split)

    def info(self, model: str = "") -> dict[str, object]:
        request = embedding_pb2.InfoRequest(model=model)
        return plain(self.stub.Info(request, timeout=self.timeout, metadata=self.metadata))

    def health(self, service: str = "") -> str:
        response = self.health_stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=self.timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> EmbeddingClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncEmbeddingClient:
    """asyncio client on grpc.aio."""

    def __init__(
        self, target: str = DEFAULT_TARGET, timeout: float | None = 30.0, security: Security = Security()
    ) -> None:
        self.channel = _channel(target, security, aio=True)
        self.stub = embedding_pb2_grpc.EmbedderStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)
        self.timeout = timeout
        self.metadata = security.metadata()
        self._max_inputs: int | None = None  # the server's inputs per request, once asked

    async def embed(
        self,
        texts: str | Sequence[str],
        truncate: bool = False,
        normalize: bool = True,
        model: str = "",
        dimensions: int | None = None,
    ) -> EmbedResult:
        """As ``EmbeddingClient.embed``: a long list goes as consecutive requests of the server's size."""
        texts = text_list(texts)
        if len(texts) > 1 and self._max_inputs is None:
            self._max_inputs = int((await self.info())["max_client_batch_size"])  # type: ignore[call-overload]
        split = parts(texts, self._max_inputs)
        results = [
            from_response(await self.stub.Embed(make_request(part, truncate, normalize, model, dimensions),
                                                timeout=self.timeout, metadata=self.metadata))
            for _, part in split
        ]  # fmt: skip
        return joined(results, split)

    async def info(self, model: str = "") -> dict[str, object]:
        request = embedding_pb2.InfoRequest(model=model)
        return plain(await self.stub.Info(request, timeout=self.timeout, metadata=self.metadata))

    async def health(self, service: str = "") -> str:
        response = await self.health_stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=self.timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncEmbeddingClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m client", description="Call the embedding service.")
    parser.add_argument("--target", default=DEFAULT_TARGET, help=f"host:port (default {DEFAULT_TARGET})")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds")
    parser.add_argument("--tls-ca", default="", help="PEM CA of the server's certificate (turns TLS on)")
    parser.add_argument("--tls-cert", default="", help="client certificate for mutual TLS")
    parser.add_argument("--tls-key", default="", help="client key for mutual TLS")
    model_help = "the served model to use (default: the server's default)"
    parser.add_argument("--model", default="", help=model_help)
    commands = parser.add_subparsers(dest="command", required=True)
    embed = commands.add_parser("embed", help="embed texts and print JSON")
    # Also after the command, beside its own flags; SUPPRESS keeps the one given before it otherwise.
    embed.add_argument("--model", default=argparse.SUPPRESS, help=model_help)
    embed.add_argument("texts", nargs="+")
    embed.add_argument("--truncate", action="store_true", help="cut inputs longer than the model's limit")
    embed.add_argument("--no-normalize", action="store_true", help="return raw, not L2-normalised, vectors")
    embed.add_argument("--dimensions", type=int, help="keep the first d components (re-normalised when normalising)")
    info = commands.add_parser("info", help="print the model and serving limits")
    info.add_argument("--model", default=argparse.SUPPRESS, help=model_help)
    health = commands.add_parser("health", help="print the health status; exit 1 unless SERVING")
    health.add_argument("--service", default="", help="service name; empty = the whole server")
    args = parser.parse_args(argv)
    try:
        token = os.environ.get("EMBED_AUTH_TOKEN", "")
        security = Security(args.tls_ca, args.tls_cert, args.tls_key, token)
        with EmbeddingClient(args.target, args.timeout, security) as client:
            if args.command == "embed":
                result = client.embed(args.texts, args.truncate, not args.no_normalize, args.model, args.dimensions)
                out: object = asdict(result)
            elif args.command == "info":
                out = client.info(args.model)
            else:
                out = {"status": client.health(args.service)}
    except grpc.RpcError as e:
        error = {"code": e.code().name, "message": e.details()}
        # The server's label for a failed call (absent when the call never reached it): quote it in a report.
        trailing = dict(e.trailing_metadata() or ())  # type: ignore[attr-defined]
        if REQUEST_ID in trailing:
            error["request_id"] = trailing[REQUEST_ID]
        print(json.dumps(error), file=sys.stderr)
        return 1
    print(json.dumps(out))
    # `health` doubles as a container health check: exit 0 only when SERVING.
    return 0 if args.command != "health" or out == {"status": "SERVING"} else 1
