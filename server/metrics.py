"""Prometheus metrics, named per pipeline stage, on their own registry (one per server instance).

Buckets are bounded and sized for this service: sub-millisecond tokenization up to multi-second
queueing under overload; batch sizes up to the largest --max-batch-size we expect.
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    start_http_server,
)
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

from server.batcher import BatchObserver

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TOKEN_BUCKETS = (16, 64, 256, 1024, 2048, 4096, 8192, 16384, 32768)
RATIO_BUCKETS = (0.0, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0)
REJECTION_REASONS = ("overloaded", "invalid", "deadline", "cancelled", "draining", "not_ready", "unauthenticated")


class Metrics(BatchObserver):
    def __init__(self) -> None:
        self.registry = registry = CollectorRegistry()
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)
        GCCollector(registry=registry)
        self.requests = Counter(
            "embed_requests", "RPCs finished, by method and gRPC status code.", ["method", "code"], registry=registry
        )
        self.request_duration = Histogram(
            "embed_request_duration_seconds",
            "End-to-end RPC latency by method (for EmbedStream: per streamed request).",
            ["method"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.tokenize_duration = Histogram(
            "embed_tokenize_duration_seconds",
            "Tokenization time per request.",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.queue_duration = Histogram(
            "embed_queue_duration_seconds",
            "Time an input waited in the queue before its batch started.",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.inference_duration = Histogram(
            "embed_inference_duration_seconds", "Inference time per batch.", buckets=LATENCY_BUCKETS, registry=registry
        )
        self.batch_size = Histogram(
            "embed_batch_size", "Inputs per batch.", buckets=BATCH_SIZE_BUCKETS, registry=registry
        )
        self.batch_tokens = Histogram(
            "embed_batch_tokens",
            "Tokens per batch: real (computed for real inputs) and padded (items x longest item).",
            ["kind"],
            buckets=TOKEN_BUCKETS,
            registry=registry,
        )
        self.padding_ratio = Histogram(
            "embed_batch_padding_ratio",
            "Share of a batch's padded tokens that are padding.",
            buckets=RATIO_BUCKETS,
            registry=registry,
        )
        self.queue_items = Gauge("embed_queue_items", "Inputs waiting in the queue.", registry=registry)
        self.queue_tokens = Gauge("embed_queue_tokens", "Real tokens waiting in the queue.", registry=registry)
        self.queue_capacity_tokens = Gauge(
            "embed_queue_capacity_tokens", "Queued tokens at which admission control refuses.", registry=registry
        )
        self.in_flight = Gauge("embed_requests_in_flight", "RPCs being served now.", registry=registry)
        self.inputs = Counter("embed_inputs", "Inputs embedded and returned.", registry=registry)
        self.tokens = Counter("embed_tokens", "Tokens of inputs embedded and returned.", registry=registry)
        self.rejections = Counter("embed_rejections", "Requests refused, by reason.", ["reason"], registry=registry)
        self.dropped_items = Counter(
            "embed_dropped_items", "Queued inputs dropped before inference, by reason.", ["reason"], registry=registry
        )
        self.batch_failures = Counter("embed_batch_failures", "Batches that failed in the backend.", registry=registry)
        self.batches = Counter("embed_batches", "Batches run by the backend.", registry=registry)
        self.model_info = Info("embed_model", "The model being served and where it runs.", registry=registry)
        for reason in REJECTION_REASONS:  # present from the start, so rate() has a series to work on
            self.rejections.labels(reason)
        for reason in ("cancelled", "deadline", "failed"):
            self.dropped_items.labels(reason)
        for kind in ("real", "padded"):
            self.batch_tokens.labels(kind)

    # ---- BatchObserver ----------------------------------------------------------------------
    def rejected(self, reason: str) -> None:
        self.rejections.labels(reason).inc()

    def dropped(self, reason: str, items: int) -> None:
        self.dropped_items.labels(reason).inc(items)

    def batch_started(self, items: int, real_tokens: int, padded_tokens: int, queue_waits: list[float]) -> None:
        self.batch_size.observe(items)
        self.batch_tokens.labels("real").observe(real_tokens)
        self.batch_tokens.labels("padded").observe(padded_tokens)
        self.padding_ratio.observe(1.0 - real_tokens / padded_tokens)
        for wait in queue_waits:
            self.queue_duration.observe(wait)

    def batch_finished(self, seconds: float, ok: bool) -> None:
        self.inference_duration.observe(seconds)
        self.batches.inc()
        if not ok:
            self.batch_failures.inc()

    def queue_changed(self, items: int, tokens: int) -> None:
        self.queue_items.set(items)
        self.queue_tokens.set(tokens)

    # ---- HTTP endpoint ----------------------------------------------------------------------
    def serve(self, host: str, port: int) -> tuple[object, int]:
        """Start /metrics in a daemon thread. Returns the HTTP server and the port it bound."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return server, int(server.server_port)
