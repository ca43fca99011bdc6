"""A load generator for the memory test: many concurrent clients each sending the largest requests.

    python -m tests.reliability.flood --target HOST:PORT [--clients 200] [--inputs 64] [--chars 20000] [--seconds 20]
        [--channels 8]

Prints one JSON line: the calls sent and the status codes they got, counted (a call that never got an
answer would be missing from the codes). Runs in its own process so that its CPU and memory are not the
server's or the test's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections import Counter

import grpc

from embedding.v1 import embedding_pb2, embedding_pb2_grpc

WORDS = [
    "the",
    "quiet",
    "river",
    "carries",
    "silt",
    "past",
    "the",
    "old",
    "mill",
    "while",
    "herons",
    "wait",
    "in",
    "the",
    "reeds",
]


def long_text(chars: int, seed: int) -> str:
    words = [WORDS[(seed + i * 7) % len(WORDS)] for i in range(chars // 3)]
    return " ".join(words)[:chars]


async def flood(
    target: str, clients: int, inputs: int, chars: int, seconds: float, channels: int = 8
) -> tuple[int, Counter[str], Counter[str]]:
    message = embedding_pb2.EmbedRequest(inputs=[long_text(chars, i) for i in range(inputs)], truncate=True)
    connections = [
        grpc.aio.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)]) for _ in range(channels)
    ]
    codes: Counter[str] = Counter()
    details: Counter[str] = Counter()  # of answers other than OK and RESOURCE_EXHAUSTED, to tell who gave them
    sent = 0
    end = time.monotonic() + seconds

    async def client(stub: embedding_pb2_grpc.EmbedderStub) -> None:
        nonlocal sent
        while time.monotonic() < end:
            sent += 1
            try:
                response = await stub.Embed(message, timeout=30)
                codes["OK" if len(response.embeddings) == inputs else "WRONG"] += 1
            except grpc.aio.AioRpcError as e:
                codes[e.code().name] += 1
                if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    details[f"{e.code().name}: {e.details()}"] += 1

    stubs = [embedding_pb2_grpc.EmbedderStub(c) for c in connections]
    await asyncio.gather(*(client(stubs[i % len(stubs)]) for i in range(clients)))
    for connection in connections:
        await connection.close()
    return sent, codes, details


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", required=True)
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--inputs", type=int, default=64)
    parser.add_argument("--chars", type=int, default=20_000)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--channels", type=int, default=8, help="connections the clients share (1: one channel)")
    args = parser.parse_args()
    sent, codes, details = asyncio.run(
        flood(args.target, args.clients, args.inputs, args.chars, args.seconds, args.channels)
    )
    print(json.dumps({"sent": sent, "codes": dict(codes), "details": dict(details)}), flush=True)


if __name__ == "__main__":
    main()
