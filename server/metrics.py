"""Prometheus metrics, named per pipeline stage, on their own registry (one per server instance).

Every series about a model carries a ``model`` label (the served name; "" where a request was
refused before it named a valid one, such as a bad token or an unknown model). ``for_model(name)``
gives one model's children, bound once: the batcher and pipeline of that model observe through it.

Buckets are bounded and sized for this service: sub-millisecond tokenization up to multi-second
queueing under overload; batch sizes up to the largest --max-batch-size we expect.
"""

from __future__ import annotations

import socket
import threading
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    make_wsgi_app,
)
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

from server.core.batcher import BatchObserver
from server.core.pipeline import PipelineObserver

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TOKEN_BUCKETS = (16, 64, 256, 1024, 2048, 4096, 8192, 16384, 32768)
RATIO_BUCKETS = (0.0, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0)
SCRAPE_READ_TIMEOUT_SECONDS = 10.0  # a /metrics connection that sends nothing for this long is closed
REJECTION_REASONS = ("overloaded", "invalid", "deadline", "cancelled", "draining", "not_ready", "unauthenticated")


class Metrics:
    def __init__(self) -> None:
        self.registry = registry = CollectorRegistry()
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)
        GCCollector(registry=registry)
        self.requests = Counter(
            "embed_requests",
            "Requests finished, by protocol (grpc, http), method, status (gRPC code name or HTTP status) and model.",
            ["protocol", "method", "code", "model"],
            registry=registry,
        )
        self.request_duration = Histogram(
            "embed_request_duration_seconds",
            "End-to-end latency by protocol, method and model (for EmbedStream: per streamed request).",
            ["protocol", "method", "model"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.tokenize_duration = Histogram(
            "embed_tokenize_duration_seconds",
            "Tokenization time per request.",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.queue_duration = Histogram(
            "embed_queue_duration_seconds",
            "Time an input waited in the queue before its batch started.",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.inference_duration = Histogram(
            "embed_inference_duration_seconds",
            "Inference time per batch.",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.batch_size = Histogram(
            "embed_batch_size", "Inputs per batch.", ["model"], buckets=BATCH_SIZE_BUCKETS, registry=registry
        )
        self.batch_tokens = Histogram(
            "embed_batch_tokens",
            "Tokens per batch: real (computed for real inputs) and padded (items x longest item).",
            ["kind", "model"],
            buckets=TOKEN_BUCKETS,
            registry=registry,
        )
        self.padding_ratio = Histogram(
            "embed_batch_padding_ratio",
            "Share of a batch's padded tokens that are padding.",
            ["model"],
            buckets=RATIO_BUCKETS,
            registry=registry,
        )
        self.queue_items = Gauge("embed_queue_items", "Inputs waiting in the queue.", ["model"], registry=registry)
        self.queue_tokens = Gauge(
            "embed_queue_tokens", "Real tokens waiting in the queue.", ["model"], registry=registry
        )
        self.queue_capacity_tokens = Gauge(
            "embed_queue_capacity_tokens",
            "Queued tokens at which admission control refuses.",
            ["model"],
            registry=registry,
        )
        self.batch_token_budget = Gauge(
            "embed_batch_token_budget",
            "Padded tokens a batch may hold now: --max-batch-tokens as lowered at warm-up, lower while batches run "
            "slower than at warm-up.",
            ["model"],
            registry=registry,
        )
        self.in_flight = Gauge(
            "embed_requests_in_flight", "Requests being served now, both protocols, all models.", registry=registry
        )
        self.request_bytes = Gauge(
            "embed_request_bytes",
            "Bytes of request bodies held (received, not yet tokenized), all protocols and models.",
            registry=registry,
        )
        self.request_bytes_capacity = Gauge(
            "embed_request_capacity_bytes",
            "The byte budget: request bodies held beyond it are refused before parsing.",
            registry=registry,
        )
        self.request_calls = Gauge(
            "embed_request_calls",
            "Calls whose body is being read or tokenized, all protocols and models.",
            registry=registry,
        )
        self.request_calls_capacity = Gauge(
            "embed_request_calls_capacity",
            "Calls whose body may be read or tokenized at once; more are refused unread.",
            registry=registry,
        )
        self.memory_limit = Gauge(
            "embed_memory_limit_bytes", "The memory limit the budgets are derived from.", registry=registry
        )
        self.http_unsent_bytes = Gauge(
            "embed_http_unsent_bytes",
            "Memory held by HTTP answers their clients have not taken (the answer written and the socket's send "
            "queue), on connections whose client reads slower than the server writes.",
            registry=registry,
        )
        self.http_unsent_capacity = Gauge(
            "embed_http_unsent_capacity_bytes",
            "The memory share for HTTP answers not yet taken: beyond it the slowest readers' connections are closed.",
            registry=registry,
        )
        self.http_slow_readers_closed = Counter(
            "embed_http_slow_readers_closed",
            "HTTP connections closed because their client was not taking its answer, by reason: send_timeout "
            "(no byte taken for --http-send-timeout-seconds) or budget (answers held past their memory share).",
            ["reason"],
            registry=registry,
        )
        for reason in ("send_timeout", "budget"):
            self.http_slow_readers_closed.labels(reason)
        self.inputs = Counter("embed_inputs", "Inputs embedded and returned.", ["model"], registry=registry)
        self.tokens = Counter("embed_tokens", "Tokens of inputs embedded and returned.", ["model"], registry=registry)
        self.rejections = Counter(
            "embed_rejections", "Requests refused, by reason and model.", ["reason", "model"], registry=registry
        )
        self.dropped_items = Counter(
            "embed_dropped_items",
            "Queued inputs dropped before inference, by reason.",
            ["reason", "model"],
            registry=registry,
        )
        self.batch_failures = Counter(
            "embed_batch_failures", "Batches that failed in the backend.", ["model"], registry=registry
        )
        self.batches = Counter("embed_batches", "Batches run by the backend.", ["model"], registry=registry)
        self.model_info = Info("embed_model", "Each served model and where it runs.", ["model"], registry=registry)
        self._models: dict[str, ModelMetrics] = {}
        self._answered: dict[tuple[str, str, str, str], tuple[Counter, Histogram]] = {}
        for reason in REJECTION_REASONS:  # present from the start, so rate() has a series to work on
            self.rejections.labels(reason, "")

    def for_model(self, name: str) -> ModelMetrics:
        """One model's series, created at once (so rate() has them from the start) and bound once."""
        if name not in self._models:
            self._models[name] = ModelMetrics(self, name)
        return self._models[name]

    def rejected(self, reason: str, model: str = "") -> None:
        self.rejections.labels(reason, model).inc()

    def answered(self, protocol: str, method: str, code: str, model: str, seconds: float) -> None:
        """One finished request: counted by its code, timed. The labelled series are looked up once each
        (prometheus_client's ``labels()`` takes a lock and builds a key on every call)."""
        key = (protocol, method, code, model)
        series = self._answered.get(key)
        if series is None:
            counter = self.requests.labels(*key)
            series = self._answered[key] = (counter, self.request_duration.labels(protocol, method, model))
        series[0].inc()
        series[1].observe(seconds)

    # ---- HTTP endpoint ----------------------------------------------------------------------
    def serve(self, host: str, port: int) -> tuple[object, int]:
        """Start /metrics in a daemon thread. Returns the HTTP server and the port it bound.

        prometheus_client's own `start_http_server` polls for shutdown every 0.5 s, which every stop
        then waits out; this is the same WSGI app on the standard library's server, polled every 50 ms.
        """
        server_class = _MetricsServer6 if ":" in host else _MetricsServer
        server = make_server(host, port, make_wsgi_app(self.registry), server_class, handler_class=_QuietHandler)
        thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        thread.start()
        return server, int(server.server_port)


class _MetricsServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a scrape in progress never holds the process open


class _MetricsServer6(_MetricsServer):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    # Each connection has a thread of its own: without a timeout, a client that connects and sends nothing
    # holds its thread for ever (200 such clients, 200 threads). A scrape sends its request at once.
    timeout = SCRAPE_READ_TIMEOUT_SECONDS

    def log_message(self, format: str, *args: object) -> None:  # one line per scrape is noise
        pass


class ModelMetrics(BatchObserver, PipelineObserver):
    """The series of one model, children bound once: observing costs no label lookup per call."""

    def __init__(self, metrics: Metrics, name: str) -> None:
        self.name = name
        self.tokenize_duration = metrics.tokenize_duration.labels(name)
        self.queue_duration = metrics.queue_duration.labels(name)
        self.inference_duration = metrics.inference_duration.labels(name)
        self.batch_size = metrics.batch_size.labels(name)
        self.real_tokens = metrics.batch_tokens.labels("real", name)
        self.padded_tokens = metrics.batch_tokens.labels("padded", name)
        self.padding_ratio = metrics.padding_ratio.labels(name)
        self.queue_items = metrics.queue_items.labels(name)
        self.queue_tokens = metrics.queue_tokens.labels(name)
        self.queue_capacity_tokens = metrics.queue_capacity_tokens.labels(name)
        self.batch_token_budget = metrics.batch_token_budget.labels(name)
        self.inputs = metrics.inputs.labels(name)
        self.tokens = metrics.tokens.labels(name)
        self.batch_failures = metrics.batch_failures.labels(name)
        self.batches = metrics.batches.labels(name)
        self.rejections = {reason: metrics.rejections.labels(reason, name) for reason in REJECTION_REASONS}
        self.dropped_items = {r: metrics.dropped_items.labels(r, name) for r in ("cancelled", "deadline", "failed")}

    def rejected(self, reason: str) -> None:
        self.rejections[reason].inc()

    # ---- PipelineObserver -------------------------------------------------------------------
    def tokenized(self, seconds: float) -> None:
        self.tokenize_duration.observe(seconds)

    def embedded(self, inputs: int, tokens: int) -> None:
        self.inputs.inc(inputs)
        self.tokens.inc(tokens)

    # ---- BatchObserver ----------------------------------------------------------------------
    def dropped(self, reason: str, items: int) -> None:
        self.dropped_items[reason].inc(items)

    def batch_started(self, items: int, real_tokens: int, padded_tokens: int, queue_waits: list[float]) -> None:
        self.batch_size.observe(items)
        self.real_tokens.observe(real_tokens)
        self.padded_tokens.observe(padded_tokens)
        self.padding_ratio.observe(1.0 - real_tokens / padded_tokens)
        for wait in queue_waits:
            self.queue_duration.observe(wait)

    def batch_finished(self, seconds: float, ok: bool) -> None:
        self.inference_duration.observe(seconds)
        self.batches.inc()
        if not ok:
            self.batch_failures.inc()

    def budget_changed(self, tokens: int) -> None:
        self.batch_token_budget.set(tokens)

    def queue_changed(self, items: int, tokens: int) -> None:
        self.queue_items.set(items)
        self.queue_tokens.set(tokens)
