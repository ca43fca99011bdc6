"""A load generator for the memory test: many concurrent clients each sending the largest requests.

    python -m tests.reliability.flood --target HOST:PORT [--clients 200] [--inputs 64] [--chars 20000] [--seconds 20]

Prints one JSON line: the status codes the clients got, counted. Runs in its own process so that its
CPU and memory are not the server's or the test's.
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


async def flood(target: str, clients: int, inputs: int, chars: int, seconds: float) -> Counter[str]:
    message = embedding_pb2.EmbedRequest(inputs=[long_text(chars, i) for i in range(inputs)], truncate=True)
    channels = [grpc.aio.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)]) for _ in range(8)]
    codes: Counter[str] = Counter()
    end = time.monotonic() + seconds

    async def client(stub: embedding_pb2_grpc.EmbedderStub) -> None:
        while time.monotonic() < end:
            try:
                response = await stub.Embed(message, timeout=30)
                codes["OK" if len(response.embeddings) == inputs else "WRONG"] += 1
            except grpc.aio.AioRpcError as e:
                codes[e.code().name] += 1

    stubs = [embedding_pb2_grpc.EmbedderStub(c) for c in channels]
    await asyncio.gather(*(client(stubs[i % len(stubs)]) for i in range(clients)))
    for channel in channels:
        await channel.close()
    return codes


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", required=True)
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--inputs", type=int, default=64)
    parser.add_argument("--chars", type=int, default=20_000)
    parser.add_argument("--seconds", type=float, default=20.0)
    args = parser.parse_args()
    codes = asyncio.run(flood(args.target, args.clients, args.inputs, args.chars, args.seconds))
    print(json.dumps(dict(codes)), flush=True)


if __name__ == "__main__":
    main()
