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
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import loadgen
from bench.measure import traffic
from loadtest.run import ROOT, local_server
from server.memory import rss_bytes

SAMPLE_SECONDS = 10.0
MAX_RSS_GROWTH = 0.10
SIZES = (1, 4, 8)  # texts per request, one size per window in turn


def drive(target: str, pid: int, seconds: float, concurrency: int, texts: list[str],
          window: float = SAMPLE_SECONDS) -> list[dict[str, Any]]:  # fmt: skip
    """Back-to-back windows of the benchmark's load generator, cycling through 1, 4 and 8 texts per request
    (so the batcher forms every shape over time); the server's RSS after each window."""
    samples: list[dict[str, Any]] = []
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        per_request = SIZES[len(samples) % len(SIZES)]
        reading: dict[str, Any] = asyncio.run(loadgen.run(target, concurrency, window, 0.0, texts, per_request))
        errors = reading["errors"] + (samples[-1]["errors"] if samples else 0)
        samples.append({"t_seconds": round(time.monotonic() - started, 1), "rss_mib": rss_bytes(pid) / 2**20,
                        "texts_per_request": per_request, "requests_per_second": reading["requests_per_second"],
                        "p50_ms": reading["p50_ms"], "p99_ms": reading["p99_ms"], "errors": errors})  # fmt: skip
        print(json.dumps(samples[-1]), flush=True)
    return samples


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--model-dir", default="artifacts")
    parser.add_argument("--out", type=Path, default=ROOT / "reports")
    args = parser.parse_args(argv)
    texts = traffic(2000)
    with local_server(args.model_dir) as server:
        samples = drive(server.target, server.process.pid, args.minutes * 60, args.concurrency, texts)
    warm = max(1, min(int(60 / SAMPLE_SECONDS), len(samples) // 2))
    baseline, final = samples[warm - 1]["rss_mib"], samples[-1]["rss_mib"]
    growth = (final - baseline) / baseline
    errors = samples[-1]["errors"]
    report = {"minutes": args.minutes, "concurrency": args.concurrency, "rss_growth_after_warmup": growth,
              "errors": errors, "samples": samples}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "soak.json").write_text(json.dumps(report, indent=2) + "\n")
    print(
        f"soak: {args.minutes} min at {args.concurrency} clients; RSS {baseline:.1f} -> {final:.1f} MiB after "
        f"warm-up ({growth:+.1%}, limit {MAX_RSS_GROWTH:.0%}); errors {errors}; report {args.out / 'soak.json'}"
    )
    return 0 if growth < MAX_RSS_GROWTH and errors == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
