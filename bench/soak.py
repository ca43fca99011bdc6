"""`make soak`: sustained load for a while, RSS and latency over time, RSS growth checked.

    python -m bench.soak [--minutes 10] [--concurrency 32] [--model-dir artifacts] [--out reports]

Every 10 s it samples the server's RSS and the window's texts/s and latency percentiles. RSS growth
from the end of warm-up (the first minute, or half the run if shorter) to the end must stay
under 10%. Not part of `make test`: it takes minutes by design.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import grpc
import numpy as np

from embedding.v1 import embedding_pb2, embedding_pb2_grpc
from loadtest.run import ROOT, local_server
from loadtest.texts import load_pool
from server.memory import rss_bytes

SAMPLE_SECONDS = 10.0
MAX_RSS_GROWTH = 0.10


async def drive(target: str, pid: int, seconds: float, concurrency: int, texts: list[str]) -> list[dict]:  # type: ignore[type-arg]
    channel = grpc.aio.insecure_channel(target)
    stub = embedding_pb2_grpc.EmbedderStub(channel)
    window: list[float] = []
    errors = 0
    stop = False

    async def worker(seed: int) -> None:
        nonlocal errors
        rng = random.Random(seed)
        while not stop:
            start = time.perf_counter()
            try:
                request = embedding_pb2.EmbedRequest(
                    inputs=rng.sample(texts, rng.choice((1, 1, 1, 4, 8))), truncate=True
                )
                await stub.Embed(request, timeout=30)
                window.append(time.perf_counter() - start)
            except grpc.aio.AioRpcError:
                errors += 1

    workers = [asyncio.create_task(worker(i)) for i in range(concurrency)]
    samples = []
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        await asyncio.sleep(SAMPLE_SECONDS)
        latencies, window[:] = np.array(window) * 1000, []
        samples.append(
            {
                "t_seconds": round(time.monotonic() - started, 1),
                "rss_mib": rss_bytes(pid) / 2**20,
                "requests_per_second": len(latencies) / SAMPLE_SECONDS,
                "p50_ms": float(np.percentile(latencies, 50)) if len(latencies) else None,
                "p99_ms": float(np.percentile(latencies, 99)) if len(latencies) else None,
                "errors": errors,
            }
        )
        print(json.dumps(samples[-1]), flush=True)
    stop = True
    await asyncio.gather(*workers)
    await channel.close()
    return samples


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--model-dir", default="artifacts")
    parser.add_argument("--out", type=Path, default=ROOT / "reports")
    args = parser.parse_args(argv)
    texts = load_pool().mixed(random.Random(0), 2000)
    with local_server(args.model_dir) as server:
        samples = asyncio.run(drive(server.target, server.process.pid, args.minutes * 60, args.concurrency, texts))
    warm = max(1, min(int(60 / SAMPLE_SECONDS), len(samples) // 2))
    baseline, final = samples[warm - 1]["rss_mib"], samples[-1]["rss_mib"]
    growth = (final - baseline) / baseline
    errors = samples[-1]["errors"]
    report = {
        "minutes": args.minutes,
        "concurrency": args.concurrency,
        "rss_growth_after_warmup": growth,
        "errors": errors,
        "samples": samples,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "soak.json").write_text(json.dumps(report, indent=2) + "\n")
    print(
        f"soak: {args.minutes} min at {args.concurrency} clients; RSS {baseline:.1f} -> {final:.1f} MiB after "
        f"warm-up ({growth:+.1%}, limit {MAX_RSS_GROWTH:.0%}); errors {errors}; report {args.out / 'soak.json'}"
    )
    return 0 if growth < MAX_RSS_GROWTH and errors == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
