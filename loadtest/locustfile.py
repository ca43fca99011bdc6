"""Locust load test for the embedding service.

make loadtest                                  # starts a local server on artifacts/, 30 s, 32 users
EMBED_TARGET=host:50051 make loadtest          # against a running service
locust -f loadtest/locustfile.py --host localhost:50051   # Locust's web UI
make loadtest LOADTEST_MODEL_INFER=1           # also the Open Inference Protocol task (tag model-infer)
make loadtest LOADTEST_PROTOCOL=http           # /v1/embeddings over HTTP (EMBED_HTTP_TARGET); or "both"
"""

from __future__ import annotations

import json
import os
import random
from typing import Any

import gevent
from locust import HttpUser, between, events, tag, task

from loadtest.grpc_user import GrpcUser
from loadtest.texts import load_pool

POOL = load_pool(os.environ.get("WORDNET_DIR", "/usr/share/wordnet"))
_environment: Any = None


@events.init.add_listener
def _on_init(environment: Any, **_: Any) -> None:
    global _environment
    _environment = environment
    # gevent's loop reads the clock when it is made and again only when it runs. Locust starts its --run-time
    # timer right after this event, before the loop has run: without this, the timer counts from the loop's
    # making, and a start-up longer than the run time (this file's imports and text pool on a loaded machine)
    # ended the run as it began.
    gevent.get_hub().loop.update_now()


@events.quit.add_listener
def _write_summary(exit_code: int, **_: Any) -> None:
    """Final per-task figures and the seconds from the start to the last request, as JSON (Locust's CSV files can
    lag the last second of a run)."""
    path = os.environ.get("LOADTEST_SUMMARY")
    if not path or _environment is None:
        return
    stats = _environment.stats
    entries = {e.name: e for e in stats.entries.values()}
    summary = {
        "exit_code": exit_code,
        "tasks": {
            name: {
                "requests": e.num_requests,
                "failures": e.num_failures,
                "avg_response_bytes": e.avg_content_length,
                "median_ms": e.median_response_time,
                "p99_ms": e.get_response_time_percentile(0.99),
            }
            for name, e in entries.items()
        },
        "total": {"requests": stats.total.num_requests, "failures": stats.total.num_failures},
        "seconds": (stats.total.last_request_timestamp or stats.total.start_time) - stats.total.start_time,
        "errors": {str(err.error): err.occurrences for err in stats.errors.values()},
    }
    with open(path, "w") as f:
        json.dump(summary, f, indent=2)


class EmbeddingUser(GrpcUser):
    wait_time = between(0.0, 0.05)

    def on_start(self) -> None:
        self.rng = random.Random()

    @task(6)
    def single_short_text(self) -> None:
        self.embed("Embed 1 short", [self.rng.choice(POOL.short + POOL.medium)])

    @task(3)
    def client_batch_of_8(self) -> None:
        self.embed("Embed 8 mixed", POOL.mixed(self.rng, 8))

    @task(1)
    def long_texts(self) -> None:
        self.embed("Embed 2 long", [self.rng.choice(POOL.long) for _ in range(2)])

    @task(1)
    def stream(self) -> None:
        self.embed_stream("EmbedStream 5x2", [POOL.mixed(self.rng, 2) for _ in range(5)])

    @tag("model-infer")
    @task(2)
    def model_infer_4_texts(self) -> None:
        self.model_infer("ModelInfer 4 mixed", POOL.mixed(self.rng, 4))


class HttpEmbeddingUser(HttpUser):
    """The OpenAI-compatible API: the same traffic mix as EmbeddingUser, POST /v1/embeddings."""

    wait_time = between(0.0, 0.05)

    def __init__(self, environment: Any) -> None:
        # --host is the gRPC target for both users; this one reads its own (Locust sets --host on every class).
        self.host = os.environ.get("EMBED_HTTP_TARGET", "http://localhost:8080")
        super().__init__(environment)
        self.rng = random.Random()
        token = os.environ.get("EMBED_AUTH_TOKEN", "")
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}

    def embed(self, name: str, texts: list[str]) -> None:
        body = {"input": texts, "encoding_format": "base64"}  # what the openai package sends by default
        with self.client.post("/v1/embeddings", json=body, headers=self.headers, name=name, catch_response=True) as r:
            if r.status_code != 200:
                error = r.json().get("error", {}) if r.headers.get("content-type") == "application/json" else {}
                r.failure(f"HTTP {r.status_code}: {error.get('message', r.text[:200])}")
            elif len(r.json()["data"]) != len(texts):
                r.failure("wrong number of embeddings")

    @task(6)
    def single_short_text(self) -> None:
        self.embed("POST /v1/embeddings 1 short", [self.rng.choice(POOL.short + POOL.medium)])

    @task(3)
    def client_batch_of_8(self) -> None:
        self.embed("POST /v1/embeddings 8 mixed", POOL.mixed(self.rng, 8))

    @task(1)
    def long_texts(self) -> None:
        self.embed("POST /v1/embeddings 2 long", [self.rng.choice(POOL.long) for _ in range(2)])
