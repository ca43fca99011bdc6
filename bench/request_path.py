"""The request path without gRPC: what our own code costs the event loop per request.

    python -m bench.request_path --model-dir artifacts --texts TEXTS.json [--callers 32] [--duration 4]

`EmbedderService.Embed` is called in-process by concurrent callers, one text per request, with the
real pipeline, batcher and ONNX Runtime, and no socket: the event-loop thread's CPU per request is
then validation, tokenization, batching, normalisation, response building and metrics, and nothing
of grpcio. Three modes, each in a fresh server, separate what the parts cost:

* ``full``: everything;
* ``pretokenized``: each text's token rows come from a table built beforehand;
* ``bare``: pretokenized, and the backend answers at once (a constant array): our Python alone.

Prints one JSON object: per mode, requests per second, event-loop and whole-process CPU-us per
request, the mean batch the batcher formed, and how many calls reached the real tokenizer and model.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from embedding.v1 import embedding_pb2
from server import loops
from server.app import create_server
from server.config import ServerConfig
from server.service import Received

MODES = ("full", "pretokenized", "bare")


class InProcessContext:
    """The little of grpc.aio.ServicerContext that Embed uses: one message to read, no deadline, abort raises."""

    def __init__(self, message: Any) -> None:
        self._message = message

    def peer(self) -> str:
        return "in-process"

    async def read(self) -> Received:
        return Received(self._message)

    def time_remaining(self) -> float | None:
        return None

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise RuntimeError(f"{code.name}: {details}")


async def measure(model_dir: str, mode: str, texts: Sequence[str], callers: int, duration: float) -> dict[str, Any]:
    server, _ = await create_server(ServerConfig(model_dir=model_dir, host="127.0.0.1", port=0, metrics_port=-1))
    try:
        model = server.default
        pipeline, batcher = model.pipeline, model.pipeline.batcher
        calls = {"tokenizer": 0, "model": 0}  # calls that reached the real ones while measuring

        def counted(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
            def call(*args: Any) -> Any:
                calls[name] += 1
                return function(*args)

            return call

        real_encode = pipeline.tokenizer.encode
        pipeline.tokenizer.encode = counted("tokenizer", real_encode)  # type: ignore[method-assign]
        batcher.swap_backend(counted("model", batcher.backend))
        if mode != "full":
            table = {text: real_encode([text], True) for text in set(texts)}
            pipeline.tokenizer.encode = lambda prepared, truncate, originals=None: table[prepared[0]]  # type: ignore[method-assign, assignment]
        if mode == "bare":
            width = 2 * model.info.dim  # the pipeline's backend returns raw and unit rows side by side
            batcher.swap_backend(lambda rows: np.full((len(rows), width), 0.1, dtype=np.float32))
        requests = [embedding_pb2.EmbedRequest(inputs=[text], truncate=True) for text in texts]
        done, running = 0, True

        async def caller(seed: int) -> None:
            nonlocal done
            rng = random.Random(seed)
            while running:
                context = InProcessContext(rng.choice(requests))
                await server.service.Embed(None, context)  # type: ignore[arg-type]
                done += 1

        tasks = [asyncio.create_task(caller(i)) for i in range(callers)]
        await asyncio.sleep(min(2.0, duration))  # warm-up
        registry, labels = server.metrics.registry, {"model": model.name}

        def batches() -> tuple[float, float]:
            return (
                registry.get_sample_value("embed_batch_size_count", labels) or 0.0,
                registry.get_sample_value("embed_batch_size_sum", labels) or 0.0,
            )

        (count0, items0), done = batches(), 0
        calls.update(tokenizer=0, model=0)
        loop0, process0, wall0 = time.thread_time(), time.process_time(), time.perf_counter()
        await asyncio.sleep(duration)
        loop_cpu, process_cpu = time.thread_time() - loop0, time.process_time() - process0
        wall, measured = time.perf_counter() - wall0, done
        count, items = batches()
        running = False
        await asyncio.gather(*tasks)
        return {
            "requests_per_second": measured / wall,
            "event_loop_cpu_us": loop_cpu / measured * 1e6,
            "process_cpu_us": process_cpu / measured * 1e6,
            "mean_batch": (items - items0) / max(1.0, count - count0),
            "tokenizer_calls": calls["tokenizer"],
            "model_calls": calls["model"],
        }
    finally:
        await server.stop(1.0)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", default="artifacts")
    parser.add_argument("--texts", type=Path, required=True, help="a JSON list of texts")
    parser.add_argument("--callers", type=int, default=32)
    parser.add_argument("--duration", type=float, default=4.0, help="seconds measured per mode")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated, from: " + ", ".join(MODES))
    args = parser.parse_args(argv)
    texts = json.loads(args.texts.read_text())
    modes = [m.strip() for m in args.modes.split(",")]
    if unknown := [m for m in modes if m not in MODES]:
        parser.error(f"unknown modes {unknown}; choose from {list(MODES)}")
    event_loop = ServerConfig().event_loop  # the server's own
    results = {
        mode: loops.run(measure(args.model_dir, mode, texts, args.callers, args.duration), event_loop) for mode in modes
    }
    print(json.dumps(results))


if __name__ == "__main__":
    main()
