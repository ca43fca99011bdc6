"""The transport ceilings: the same request answered with a fixed vector, with no tokenizer and no model.

    python -m bench.transport --port 50061 [--dim 128] [--protocol grpc|http]

gRPC: a minimal grpc.aio server from the same proto on the server's default event loop, with health. HTTP: a raw
ASGI app on the server's stack (uvicorn with httptools). Loaded by the same load generator as the real server, each
in its own process: the difference is everything the real server does beyond the protocol itself.
"""

from __future__ import annotations

import argparse
import base64
import json
from collections.abc import Sequence
from typing import Any

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from embedding.v1 import embedding_pb2, embedding_pb2_grpc
from server import loops
from server.config import ServerConfig


class FixedEmbedder(embedding_pb2_grpc.EmbedderServicer):
    def __init__(self, dim: int) -> None:
        self._vector = [1.0 / dim**0.5] * dim

    async def Embed(
        self, request: embedding_pb2.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> embedding_pb2.EmbedResponse:
        return embedding_pb2.EmbedResponse(
            embeddings=[embedding_pb2.Embedding(values=self._vector) for _ in request.inputs]
        )


async def serve_grpc(port: int, dim: int) -> None:
    server = grpc.aio.server()
    embedding_pb2_grpc.add_EmbedderServicer_to_server(FixedEmbedder(dim), server)
    checks = health.aio.HealthServicer()
    await checks.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(checks, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def fixed_app(dim: int) -> Any:
    """The HTTP ceiling's ASGI app: every request's body read, then one embedding of the model's width answered in
    OpenAI's response shape (base64), never computed."""
    vector = base64.b64encode(np.zeros(dim, dtype="<f4").tobytes()).decode()
    data = [{"object": "embedding", "index": 0, "embedding": vector}]
    usage = {"prompt_tokens": 1, "total_tokens": 1}
    body = json.dumps({"object": "list", "data": data, "model": "fixed", "usage": usage}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        more = True
        while more:
            more = (await receive()).get("more_body", False)
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return app


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--protocol", choices=("grpc", "http"), default="grpc")
    args = parser.parse_args(argv)
    if args.protocol == "grpc":
        loops.run(serve_grpc(args.port, args.dim), ServerConfig().event_loop)
        return
    import uvicorn

    uvicorn.run(fixed_app(args.dim), host="127.0.0.1", port=args.port, http="httptools", lifespan="off",
                access_log=False, log_level="warning")  # fmt: skip


if __name__ == "__main__":
    main()
