"""A light asyncio load generator for gRPC or HTTP, run as its own process by the benchmark.

    python -m bench.loadgen --target host:port --concurrency 32 --duration 8 --texts texts.json [--protocol http]

Closed loop: each of `concurrency` workers sends a request of one text (or --texts-per-request), waits for the
answer, sends the next. Prints one JSON object: texts/s, latency percentiles (ms), errors, CPU per request.
HTTP: one keep-alive HTTP/1.1 connection per worker posting what the openai package sends (base64), over plain
asyncio streams, so the client costs about what grpc.aio's C core costs the gRPC side. gRPC: the workers share one
connection, as one client's channel does, or --grpc-connections of them (the fair queue's clients).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import grpc
import numpy as np
import psutil

from embedding.v1 import embedding_pb2, embedding_pb2_grpc


def thread_cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of a process: its main thread (the event loop) and all others."""
    threads = psutil.Process(pid).threads()
    main = sum(t.user_time + t.system_time for t in threads if t.id == pid)
    return {"main_thread": main, "other_threads": sum(t.user_time + t.system_time for t in threads) - main}


def percentiles(ms: np.ndarray) -> dict[str, float]:
    """p50_ms and p99_ms of latencies in milliseconds (NaN when there are none)."""
    return {f"p{q}_ms": float(np.percentile(ms, q)) if len(ms) else float("nan") for q in (50, 99)}


class HttpConnection:
    """One keep-alive HTTP/1.1 connection posting JSON to /v1/embeddings; just enough HTTP for the server's answers."""

    def __init__(self, target: str) -> None:
        self.host, port = target.rsplit(":", 1)
        self.port = int(port)
        self.streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def post(self, body: bytes) -> int:
        if self.streams is None:
            self.streams = await asyncio.open_connection(self.host, self.port)
        reader, writer = self.streams
        head = f"POST /v1/embeddings HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
        writer.write(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
        status_line = await reader.readline()
        length = 0
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        await reader.readexactly(length)
        return int(status_line.split()[1])


async def run(target: str, concurrency: int, duration: float, warmup: float, texts: list[str], per_request: int = 1,
              watch_pid: int | None = None, protocol: str = "grpc", raw_latencies: bool = False,
              grpc_connections: int = 1, model: str = "") -> dict[str, object]:  # fmt: skip
    # Channels to one target share one connection unless each keeps its own subchannel pool.
    options = [("grpc.use_local_subchannel_pool", 1)] if grpc_connections > 1 else []
    channels = [grpc.aio.insecure_channel(target, options=options) for _ in range(grpc_connections)]
    stubs = [embedding_pb2_grpc.EmbedderStub(channel) for channel in channels]
    latencies: list[float] = []
    error_kinds: Counter[str] = Counter()  # gRPC status name, or the exception's type for HTTP
    measuring = False
    stop = False
    named = {"model": model} if model else {}  # HTTP: the default model's requests stay as the benchmark sends them

    async def worker(seed: int) -> None:
        rng = random.Random(seed)
        http = HttpConnection(target) if protocol == "http" else None
        while not stop:
            sample = rng.sample(texts, per_request)
            start = time.perf_counter()
            try:
                if http is not None:
                    body = json.dumps({"input": sample, "encoding_format": "base64", **named}).encode()
                    if await http.post(body) != 200:
                        raise OSError("not 200")
                else:
                    stub = stubs[seed % len(stubs)]
                    await stub.Embed(embedding_pb2.EmbedRequest(inputs=sample, truncate=True, model=model), timeout=30)
                if measuring:
                    latencies.append(time.perf_counter() - start)
            except (grpc.aio.AioRpcError, OSError, asyncio.IncompleteReadError, ValueError, IndexError) as e:
                error_kinds[e.code().name if isinstance(e, grpc.aio.AioRpcError) else type(e).__name__] += 1
                if http is not None:
                    http.streams = None

    workers = [asyncio.create_task(worker(i)) for i in range(concurrency)]
    await asyncio.sleep(warmup)
    measuring = True
    started = time.perf_counter()
    cpu_before = thread_cpu_seconds(watch_pid) if watch_pid else {}
    own_before = time.process_time()
    await asyncio.sleep(duration)
    measuring = False
    elapsed = time.perf_counter() - started
    own_cpu = time.process_time() - own_before
    server_cpu = {k: v - cpu_before[k] for k, v in thread_cpu_seconds(watch_pid).items()} if watch_pid else {}
    stop = True
    await asyncio.gather(*workers)
    for channel in channels:
        await channel.close()
    ms = np.array(latencies) * 1000
    return {
        "concurrency": concurrency, "texts_per_request": per_request,
        "texts_per_second": len(latencies) * per_request / elapsed, "requests_per_second": len(latencies) / elapsed,
        **percentiles(ms), "requests": len(latencies),
        "errors": sum(error_kinds.values()), "error_kinds": dict(error_kinds),
        # CPU per request (microseconds) while measuring: where the two shared cores go.
        "loadgen_cpu_us": 1e6 * own_cpu / max(1, len(latencies)),
        **{f"server_{k}_cpu_us": 1e6 * v / max(1, len(latencies)) for k, v in server_cpu.items()},
        "server_cores": sum(server_cpu.values()) / elapsed if server_cpu else float("nan"),
        **({"latencies_ms": ms.round(3).tolist()} if raw_latencies else {}),
    }  # fmt: skip


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", required=True)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--duration", type=float, default=8.0)
    parser.add_argument("--warmup", type=float, default=1.5)
    parser.add_argument("--texts", required=True, help="JSON list of texts")
    parser.add_argument("--texts-per-request", dest="per_request", type=int, default=1)
    parser.add_argument("--watch-pid", type=int, help="also report this server process's CPU per request")
    parser.add_argument("--protocol", choices=("grpc", "http"), default="grpc")
    parser.add_argument("--raw-latencies", action="store_true", help="also print every latency (to merge processes)")
    parser.add_argument("--grpc-connections", type=int, default=1, help="gRPC: the clients over this many connections")
    parser.add_argument("--model", default="", help="the served model's name (default: the server's default model)")
    args = vars(parser.parse_args(argv))
    args["texts"] = json.loads(Path(args["texts"]).read_text())
    json.dump(asyncio.run(run(**args)), sys.stdout)


if __name__ == "__main__":
    main()
