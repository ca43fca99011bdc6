"""Server assembly and life cycle: gRPC server, health, reflection, metrics, model loading, drain.

``create_server(config)`` starts everything and returns ``(server, port)``; ``main()`` adds signal
handling. Health is NOT_SERVING until every model is loaded and warmed up, and again while draining.
Health names: "" (the server), each service, and ``model/<name>`` per model; the server and service
entries are NOT_SERVING while any model's backend fails, the model entry only for that model.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import ssl
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import grpc
import uvicorn
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from embedding.v1 import embedding_pb2
from server import loops, memory
from server.api.grpc import SERVICE_NAME, EmbedderService, add_to_server
from server.api.http.app import HttpApi
from server.api.http.connection import UnsentAnswers, protocol_class
from server.api.oip import SERVICE_NAME as INFERENCE_SERVICE_NAME
from server.api.oip import OpenInferenceService
from server.api.oip import add_to_server as add_inference_to_server
from server.api.rpc import status_for
from server.auth import BearerTokenInterceptor, server_credentials
from server.backend.ort import OnnxBackend, ProviderUnavailable
from server.config import ServerConfig, parse_config
from server.core.admission import Admission
from server.core.batcher import Batcher
from server.core.pipeline import Limits, Pipeline
from server.core.registry import VERSION, ServedModel, ServingState
from server.loading import LoadedModel, batch_policy, load_model
from server.metrics import Metrics

log = logging.getLogger("server")
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
PROBE_TEXT = "backend probe"
SERVER_HEALTH_NAMES = ("", SERVICE_NAME, INFERENCE_SERVICE_NAME)  # follow every model's backend


class CannotListen(Exception):
    """A port this server was told to listen on cannot be bound: in use, or not an address of this host."""


def _cannot_listen(what: str, settings: str, host: str, port: int, error: Exception) -> CannotListen:
    # gRPC's RuntimeError carries no reason (its core logs it); a socket's OSError says which.
    reason = error.strerror if isinstance(error, OSError) and error.strerror else "in use, or not an address here"
    return CannotListen(f"cannot listen for {what} on {host}:{port} ({settings}): {reason}")


class EmbeddingServer:
    """One serving process: owns the gRPC server, a batcher per model and the metrics endpoint."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.metrics = Metrics()
        self.state = ServingState(config.idle_poll_us / 1e6)
        self.health = health.aio.HealthServicer()
        self.port = 0
        self.metrics_port = 0
        self._metrics_http: object | None = None
        self._background: set[asyncio.Task[None]] = set()
        interceptors = []
        token = config.bearer_token()  # ValueError for an empty token file: never serve open by accident
        if token:
            protected = (f"/{SERVICE_NAME}/", f"/{INFERENCE_SERVICE_NAME}/")
            interceptors.append(BearerTokenInterceptor(token, protected, status_for, self._unauthenticated))
        # Until the models are loaded and the memory plan is made, one largest message (nothing is served yet).
        self.admission = Admission(config.max_message_bytes, 1)
        # Read when scraped, not set on every request: the counts live in the state and the admission.
        self.metrics.in_flight.set_function(lambda: self.state.in_flight)
        self.metrics.request_bytes.set_function(lambda: self.admission.held_bytes)
        self.metrics.request_calls.set_function(lambda: self.admission.calls)
        self.unsent = UnsentAnswers(config.http_send_timeout_seconds, metrics=self.metrics)
        self.metrics.http_unsent_bytes.set_function(lambda: self.unsent.held_bytes)
        self.memory_plan: memory.MemoryPlan | None = None
        # A connection's handshake (TLS, HTTP/2's preface) bounded as HTTP's headers are, not by gRPC's 60-120 s.
        handshake = ("grpc.server_handshake_timeout_ms", round(config.http_header_timeout_seconds * 1000))
        options = [
            ("grpc.so_reuseport", 1 if config.reuse_port else 0),
            ("grpc.max_receive_message_length", config.max_message_bytes),
            ("grpc.max_send_message_length", config.max_message_bytes),
            ("grpc.http2.bdp_probe", 1 if config.grpc_bdp_probe else 0),
            handshake,
        ]
        if config.grpc_max_connection_age_seconds > 0:  # else gRPC's default: a connection lives as long as its client
            options.append(("grpc.max_connection_age_ms", round(config.grpc_max_connection_age_seconds * 1000)))
            if config.grpc_max_connection_age_grace_seconds > 0:  # else calls in progress finish, however long
                grace = round(config.grpc_max_connection_age_grace_seconds * 1000)
                options.append(("grpc.max_connection_age_grace_ms", grace))
        self.grpc_server = grpc.aio.server(
            interceptors=interceptors,
            # Counted by gRPC before a call's message is read: beyond it the call is refused unread.
            maximum_concurrent_rpcs=config.max_concurrent_rpcs,
            options=options,
        )
        self.service = EmbedderService(self.state, self.metrics, self._limits(), self.admission, config.max_streams)
        add_to_server(self.service, self.grpc_server, self.admission)
        self.inference = OpenInferenceService(self.state, self.metrics, self.admission, VERSION)
        add_inference_to_server(self.inference, self.grpc_server, self.admission)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc_server)
        self.http_api = HttpApi(
            self.state,
            self.metrics,
            self.admission,
            self._http_info,
            token,
            config.max_message_bytes,
            config.http_body_timeout_seconds,
            config.auto_truncate,
            config.cors_origins(),
            config.http_max_inputs,
        )
        self.http_server: uvicorn.Server | None = None
        self._http_socket: socket.socket | None = None
        self.http_port = 0
        # The Open Inference Protocol is left out: its messages live in a private pool (server/api/oip.py),
        # and its clients (tritonclient, perf_analyzer) bring the published proto.
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self.grpc_server
        )
        # With TLS on, Kubernetes' gRPC probes (plaintext only) cannot reach the main port: a plaintext
        # port that serves nothing but the same health service answers them.
        self.health_server: grpc.aio.Server | None = None
        self.health_port = 0
        if config.health_port >= 0:
            self.health_server = grpc.aio.server(options=[handshake])
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_server)

    def _limits(self) -> embedding_pb2.InfoResponse:
        """The serving limits part of Info: the configured ones and, once loaded, the memory plan's."""
        config, plan = self.config, self.memory_plan
        return embedding_pb2.InfoResponse(
            max_batch_size=config.max_batch_size,
            max_client_batch_size=config.max_client_batch_size,
            max_queue_tokens=config.max_queue_tokens,
            max_delay_seconds=config.max_delay_seconds,
            max_concurrent_rpcs=config.max_concurrent_rpcs,
            memory_limit_bytes=plan.limit_bytes if plan else 0,
            memory_limit_source=plan.limit_source if plan else "",
            max_request_bytes=self.admission.max_bytes,
            max_request_calls=self.admission.max_calls,
        )

    def _http_info(self) -> dict[str, Any]:
        """GET /info: the same facts as the gRPC Info, every model and the serving limits."""
        config, plan = self.config, self.memory_plan
        return {
            "models": [{**asdict(m.info), "is_default": i == 0} for i, m in enumerate(self.state.models.values())],
            "max_batch_size": config.max_batch_size,
            "max_client_batch_size": config.max_client_batch_size,
            "max_queue_tokens": config.max_queue_tokens,
            "max_delay_seconds": config.max_delay_seconds,
            "max_concurrent_rpcs": config.max_concurrent_rpcs,
            "memory_limit_bytes": plan.limit_bytes if plan else 0,
            "memory_limit_source": plan.limit_source if plan else "",
            "max_request_bytes": self.admission.max_bytes,
            "max_request_calls": self.admission.max_calls,
            "auto_truncate": config.auto_truncate,
        }

    async def _start_http(self) -> None:
        """uvicorn on this event loop, on a socket bound here (port 0 works; the bound port is known)."""
        config = self.config
        family = socket.AF_INET6 if ":" in config.http_host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if config.reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            sock.bind((config.http_host, config.http_port))
        except OSError as e:
            sock.close()
            raise _cannot_listen("HTTP", "--http-port, EMBED_HTTP_PORT", config.http_host, config.http_port, e) from e
        sock.set_inheritable(True)
        tls: dict[str, Any] = {}
        if config.tls_cert:
            tls = {"ssl_certfile": config.tls_cert, "ssl_keyfile": config.tls_key}
            if config.tls_client_ca:
                tls.update(ssl_ca_certs=config.tls_client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
        server = uvicorn.Server(
            uvicorn.Config(
                self.http_api,
                loop="none",  # this loop: the gRPC server's
                http=protocol_class(config.http_header_timeout_seconds, self.metrics, self.unsent),
                lifespan="off",
                # The connection is the client (admission and fair queueing): X-Forwarded-For from a
                # local sender must not choose another client's share, and the middleware costs a call.
                proxy_headers=False,
                access_log=False,
                log_config=None,  # its records go through the server's own handler and format, not uvicorn's
                log_level="warning",
                timeout_keep_alive=5,
                timeout_graceful_shutdown=int(max(1, config.grace_seconds)),
                server_header=False,
                **tls,
            )
        )
        server.config.load()
        server.lifespan = server.config.lifespan_class(server.config)
        await server.startup(sockets=[])  # its state, with no listener: the one below bounds the TLS handshake
        server.servers = [await self._listen_http(server, sock)]
        await server.on_tick(0)  # the default headers (date); no main loop runs: stop() shuts it down
        self.http_server, self._http_socket = server, sock
        self.http_port = int(sock.getsockname()[1])

    async def _listen_http(self, server: uvicorn.Server, sock: socket.socket) -> asyncio.Server:
        """uvicorn's listener, as its own startup makes it, but with TLS handshakes bounded by the header timeout:
        uvicorn sets no bound, so asyncio's 60 s default let a client that connects and never says hello hold
        its connection six times as long as one that sends no headers."""
        config = server.config

        def connection() -> asyncio.Protocol:
            return config.http_protocol_class(  # type: ignore[call-arg]
                config=config, server_state=server.server_state, app_state=server.lifespan.state
            )

        handshake = self.config.http_header_timeout_seconds if config.ssl else None
        loop = asyncio.get_running_loop()
        return await loop.create_server(
            connection, sock=sock, ssl=config.ssl, backlog=config.backlog, ssl_handshake_timeout=handshake
        )

    def _unauthenticated(self, method: str) -> None:
        """A call the bearer-token check refused: counted like any other answer the client got."""
        self.metrics.rejected("unauthenticated")
        self.metrics.requests.labels("grpc", method, grpc.StatusCode.UNAUTHENTICATED.name, "").inc()

    @property
    def default(self) -> ServedModel:
        """The default model (the first); only once the server is loaded."""
        model = self.state.find("")
        if model is None:
            raise RuntimeError("no model loaded yet")
        return model

    @property
    def batcher(self) -> Batcher:
        return self.default.batcher

    async def _set_health(self, status: health_pb2.HealthCheckResponse.ServingStatus) -> None:
        for name in SERVER_HEALTH_NAMES:
            await self.health.set(name, status)
        for name in self.state.models:
            await self.health.set(f"model/{name}", status)

    def _backend_health(self, model: str, healthy: bool) -> None:
        """Called by a model's batcher when its backend starts or stops failing every batch."""
        if healthy:
            log.info("backend of %s recovered: SERVING", model)
            self.state.unhealthy.discard(model)
        else:
            log.error("backend of %s failing every batch: NOT_SERVING until a batch succeeds", model)
            self.state.unhealthy.add(model)

        async def update() -> None:
            server_status = SERVING if not self.state.unhealthy else NOT_SERVING
            for name in SERVER_HEALTH_NAMES:
                await self.health.set(name, server_status)
            await self.health.set(f"model/{model}", SERVING if healthy else NOT_SERVING)

        task = asyncio.get_running_loop().create_task(update())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def start(self) -> int:
        """Listens on every configured port; CannotListen (nothing left listening) where one cannot be bound."""
        try:
            await self._listen()
        except CannotListen:
            await self._stop_listening()
            raise
        log.info("%s, event loop %s; loading model", self._listening(), loops.running_loop_name())
        return self.port

    def _listening(self) -> str:
        """Where each protocol listens, as bound (port 0 becomes the port taken), or that it is off (-1)."""
        config = self.config
        http = f"HTTP on {config.http_host}:{self.http_port}" if config.http_port >= 0 else "HTTP off"
        metrics = f"metrics on {config.metrics_host}:{self.metrics_port}" if config.metrics_port >= 0 else "metrics off"
        return f"gRPC on {config.host}:{self.port}, {http}, {metrics}"

    async def _listen(self) -> None:
        config = self.config
        await self._set_health(NOT_SERVING)
        address = f"{config.host}:{config.port}"
        try:
            if config.tls_cert:
                credentials = server_credentials(config.tls_cert, config.tls_key, config.tls_client_ca)
                self.port = self.grpc_server.add_secure_port(address, credentials)
            else:
                self.port = self.grpc_server.add_insecure_port(address)
        except RuntimeError as e:
            raise _cannot_listen("gRPC", "--port, EMBED_PORT", config.host, config.port, e) from e
        await self.grpc_server.start()
        if self.health_server is not None:
            try:
                self.health_port = self.health_server.add_insecure_port(f"{config.health_host}:{config.health_port}")
            except RuntimeError as e:
                settings = "--health-port, EMBED_HEALTH_PORT"
                raise _cannot_listen("the health service", settings, config.health_host, config.health_port, e) from e
            await self.health_server.start()
            log.info("plaintext health service on %s:%d", config.health_host, self.health_port)
        if config.http_port >= 0:
            await self._start_http()
        if config.metrics_port >= 0:
            try:
                self._metrics_http, self.metrics_port = self.metrics.serve(config.metrics_host, config.metrics_port)
            except OSError as e:
                settings = "--metrics-port, EMBED_METRICS_PORT"
                raise _cannot_listen("metrics", settings, config.metrics_host, config.metrics_port, e) from e

    async def _stop_listening(self) -> None:
        """What _listen started, stopped at once (no model is loaded yet: nothing to drain)."""
        await self.grpc_server.stop(0)
        if self.health_server is not None:
            await self.health_server.stop(0)
        if self.http_server is not None:
            for listener in self.http_server.servers:
                listener.close()
            await self.http_server.shutdown()

    async def load(self) -> None:
        """Load and warm up every model off the event loop (health checks answer meanwhile), then serve."""
        limits = Limits(self.config.max_client_batch_size, self.config.max_input_chars)
        served: list[ServedModel] = []
        for name, folder in self.config.model_dirs():
            loaded = await asyncio.to_thread(load_model, folder, self.config, name)
            if any(model.name == loaded.info.name for model in served):
                raise ValueError(f"two models are named {loaded.info.name!r}: name one with --model NAME={folder}")
            served.append(self._serve_model(loaded, limits))
        self._plan_memory()  # ValueError when the limit cannot hold these models: nothing is served
        self.state.serve(served)
        await self._set_health(SERVING)
        for model in served:
            info = model.info
            log.info(
                "serving %s (%s %s) on %s, precision %s, dim %d, max length %d, max batch tokens %d",
                info.name,
                info.model_id,
                info.model_version,
                info.execution_provider,
                info.precision,
                info.dim,
                info.max_input_length,
                info.max_batch_tokens,
            )

    def _plan_memory(self) -> None:
        """The byte budget from the memory limit and what the warm models take (server/memory.py)."""
        config = self.config
        limit = memory.memory_limit(config.memory_limit_mib)
        plan = memory.plan(limit, memory.rss_bytes(), config.max_message_bytes, config.max_request_bytes)
        self.memory_plan = plan
        self.admission.resize(plan.request_bytes, plan.request_calls)
        self.unsent.capacity = plan.unsent_bytes
        self.metrics.http_unsent_capacity.set(plan.unsent_bytes)
        self.metrics.request_bytes_capacity.set(plan.request_bytes)
        self.metrics.request_calls_capacity.set(plan.request_calls)
        self.metrics.memory_limit.set(plan.limit_bytes)
        self.service.set_limits(self._limits())
        log.info("%s; at most %d calls in progress", plan.describe(), config.max_concurrent_rpcs)

    def _serve_model(self, loaded: LoadedModel, limits: Limits) -> ServedModel:
        """A loaded model's batcher, pipeline and metrics; its batcher starts at once."""
        info = loaded.info
        policy = batch_policy(self.config, info.max_batch_tokens, loaded.runtime.batch_cost(), info.inline_batch_tokens)
        metrics = self.metrics.for_model(info.name)
        batcher = Batcher(
            OnnxBackend(loaded.runtime),
            policy,
            observer=metrics,
            on_backend_health=lambda healthy: self._backend_health(info.name, healthy),
            probe_rows=loaded.tokenizer.encode([PROBE_TEXT], truncate=True).rows,
            probe_interval=self.config.backend_probe_seconds,
        )
        metrics.queue_capacity_tokens.set(policy.max_queue_tokens)
        batcher.start()
        self.metrics.model_info.labels(info.name).info(
            {
                "model_id": info.model_id,
                "model_version": info.model_version,
                "dim": str(info.dim),
                "max_length": str(info.max_input_length),
                "provider": info.execution_provider,
                "precision": info.precision,
                # Beside CUDA too, batches up to this size run on one CPU thread (decisions/0011).
                "one_thread_batch_tokens": str(info.one_thread_batch_tokens),
            }
        )
        pipeline = Pipeline(loaded.tokenizer, batcher, limits, metrics, self.config.tokenizer_threads, info.dim)
        return ServedModel(info, pipeline)

    async def stop(self, grace: float | None = None) -> None:
        """Drain without refusing anything that reached this server.

        Health turns NOT_SERVING at once and requests go on being served for ``drain_delay_seconds``,
        while load balancers take the server out of rotation. Then gRPC's own stop refuses new calls
        at the transport (GOAWAY: a client retries those elsewhere, transparently) and the calls in
        progress get ``grace`` seconds to finish; only then do the batcher and metrics stop.
        """
        grace = self.config.grace_seconds if grace is None else grace
        delay = self.config.drain_delay_seconds
        log.info("draining: NOT_SERVING; serving on for %.1f s, then %.1f s for calls in progress", delay, grace)
        self.state.draining = True
        await self.health.enter_graceful_shutdown()
        if delay > 0:
            await asyncio.sleep(delay)
        deadline = time.monotonic() + grace
        stopping = asyncio.create_task(self.grpc_server.stop(grace))
        if self.http_server is not None:  # stops accepting; requests in progress get the same grace
            for listener in self.http_server.servers:
                listener.close()
            await asyncio.sleep(0.01)  # a turn of the loop reads what reached the sockets: those requests are served
            http_stopping = asyncio.create_task(self.http_server.shutdown())
        while self.state.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        cut_off = self.state.in_flight
        await stopping
        if self.http_server is not None:
            await http_stopping
        if self.health_server is not None:
            await self.health_server.stop(0)
        for model in self.state.models.values():
            await model.batcher.drain(timeout=1.0)
            await model.batcher.close()
            model.pipeline.close()
        if self._metrics_http is not None:  # waits out its serve loop's 0.5 s poll: off the event loop
            await asyncio.to_thread(self._metrics_http.shutdown)  # type: ignore[attr-defined]
        answered = sum(
            s.value
            for family in self.metrics.requests.collect()
            for s in family.samples
            if s.name.endswith("_total")
            and s.labels["code"] in ("OK", "200")
            and s.labels["method"] in ("Embed", "ModelInfer", "POST /v1/embeddings")
        )
        log.info(
            "stopped: %d embedding requests (gRPC and HTTP) answered OK, %d calls cut off by the grace period",
            answered,
            cut_off,
        )


async def create_server(config: ServerConfig, load: bool = True) -> tuple[EmbeddingServer, int]:
    """Start serving on config.port (0 picks a free port) and return the server and the bound port."""
    server = EmbeddingServer(config)
    port = await server.start()
    if load:
        await server.load()
    return server, port


async def serve(config: ServerConfig) -> None:
    # Handlers first: a SIGTERM while the ports are bound (a rollout cancelled at once) stops us cleanly too.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    server = EmbeddingServer(config)
    await server.start()
    loader = asyncio.create_task(server.load())
    done, _ = await asyncio.wait({loader, asyncio.create_task(stop.wait())}, return_when=asyncio.FIRST_COMPLETED)
    if loader in done and loader.exception() is not None:
        await server.stop(0)
        raise loader.exception()  # type: ignore[misc]
    await stop.wait()
    loader.cancel()
    await server.stop()


def main(argv: Sequence[str] | None = None) -> None:
    config = parse_config(argv)
    logging.basicConfig(level=config.logging_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log.info("allocator: %s", memory.allocator_in_use())
    try:
        config.bearer_token()  # an empty or unreadable token file stops us here, before anything listens
    except (OSError, ValueError) as e:
        log.error("%s", e)
        sys.exit(2)
    if config.workers > 1:
        from server.workers import run_workers

        sys.exit(run_workers(config, sys.argv[1:] if argv is None else list(argv)))
    try:
        loops.run(serve(config), config.event_loop)
    # Missing artifacts, a memory limit too small for the models, a port or TLS file unusable, CUDA absent:
    # one line and exit 2, the code for "the configuration cannot run here".
    except (FileNotFoundError, ValueError, CannotListen, ProviderUnavailable) as e:
        log.error("%s", e)
        sys.exit(2)
