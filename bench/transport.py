"""The transport ceiling: a minimal grpc.aio server from the same proto, with no tokenizer and no model.

    python -m bench.transport --port 50061 [--dim 128] [--hold-ms 0] [--event-loop uvloop]

Every Embed is answered with one fixed ``dim``-float vector per input (health answers SERVING so the
benchmark's wait works unchanged). The same load generator that measures the real server measures this
one, in its own process: the difference is everything the real server does beyond gRPC itself. It runs
on the server's default event loop unless told otherwise, so the loop is not part of that difference.

``--hold-ms`` holds every call that long before answering, as a batching server holds its calls while
they queue and compute: gRPC alone then runs at the server's rate with as many calls open, and its cost
per request there can be told apart from the cost at its own, much higher, saturated rate.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from embedding.v1 import embedding_pb2, embedding_pb2_grpc
from server import loops
from server.config import ServerConfig


class FixedEmbedder(embedding_pb2_grpc.EmbedderServicer):
    def __init__(self, dim: int, hold_seconds: float = 0.0) -> None:
        self._vector = [1.0 / dim**0.5] * dim
        self._hold_seconds = hold_seconds

    async def Embed(
        self, request: embedding_pb2.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> embedding_pb2.EmbedResponse:
        if self._hold_seconds:
            await asyncio.sleep(self._hold_seconds)
        return embedding_pb2.EmbedResponse(
            embeddings=[embedding_pb2.Embedding(values=self._vector) for _ in request.inputs]
        )


async def serve(port: int, dim: int, hold_seconds: float = 0.0) -> None:
    server = grpc.aio.server()
    embedding_pb2_grpc.add_EmbedderServicer_to_server(FixedEmbedder(dim, hold_seconds), server)
    checks = health.aio.HealthServicer()
    await checks.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(checks, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--hold-ms", type=float, default=0.0, help="hold every call this long before answering")
    parser.add_argument("--event-loop", choices=list(loops.EVENT_LOOPS), default=ServerConfig().event_loop)
    args = parser.parse_args(argv)
    loops.run(serve(args.port, args.dim, args.hold_ms / 1000), args.event_loop)


if __name__ == "__main__":
    main()
