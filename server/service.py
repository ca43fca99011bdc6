"""The gRPC servicer: the only module that knows protobuf, and the one table of error -> status code."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from embedding.v1 import embedding_pb2, embedding_pb2_grpc
from server.errors import (
    Cancelled,
    DeadlineExceeded,
    EmbedError,
    InferenceFailed,
    Internal,
    InvalidInput,
    NotReady,
    Overloaded,
    Unauthenticated,
)
from server.metrics import Metrics
from server.pipeline import Embedded, Pipeline

log = logging.getLogger(__name__)
SERVICE_NAME = embedding_pb2.DESCRIPTOR.services_by_name["Embedder"].full_name

# The one translation table from domain errors to gRPC status codes (README, "Status codes").
STATUS_FOR_ERROR: dict[type[EmbedError], grpc.StatusCode] = {
    InvalidInput: grpc.StatusCode.INVALID_ARGUMENT,
    Overloaded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    NotReady: grpc.StatusCode.UNAVAILABLE,
    DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    Cancelled: grpc.StatusCode.CANCELLED,
    InferenceFailed: grpc.StatusCode.INTERNAL,
    Internal: grpc.StatusCode.INTERNAL,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
}

# Reasons for embed_rejections_total; InferenceFailed is counted as embed_batch_failures_total.
REJECTION_REASON: dict[type[EmbedError], str] = {
    InvalidInput: "invalid",
    Overloaded: "overloaded",
    NotReady: "draining",
    DeadlineExceeded: "deadline",
    Cancelled: "cancelled",
}

STREAM_WINDOW = 16  # requests of one stream computed concurrently; reading pauses beyond that


class MalformedRequest:
    """Stands in for a request whose bytes are not a valid protobuf message (answered INVALID_ARGUMENT).

    gRPC's own deserialization failure would surface as UNKNOWN with a traceback in the log.
    """

    def __init__(self, error: Exception) -> None:
        self.message = f"malformed request: {error}"


def _lenient(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except DecodeError as e:
            return MalformedRequest(e)

    return deserialize


def add_to_server(service: EmbedderService, server: grpc.aio.Server) -> None:
    """Like the generated add_EmbedderServicer_to_server, with malformed bytes answered INVALID_ARGUMENT."""
    pb = embedding_pb2
    handlers = {
        "Embed": grpc.unary_unary_rpc_method_handler(
            service.Embed, _lenient(pb.EmbedRequest.FromString), pb.EmbedResponse.SerializeToString
        ),
        "EmbedStream": grpc.stream_stream_rpc_method_handler(
            service.EmbedStream, _lenient(pb.EmbedRequest.FromString), pb.EmbedResponse.SerializeToString
        ),
        "Info": grpc.unary_unary_rpc_method_handler(
            service.Info, _lenient(pb.InfoRequest.FromString), pb.InfoResponse.SerializeToString
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


def status_for(error: EmbedError) -> grpc.StatusCode:
    return STATUS_FOR_ERROR.get(type(error), grpc.StatusCode.INTERNAL)


def as_domain_error(error: Exception, method: str) -> EmbedError:
    """A domain error as it is; anything else is a bug: logged with its traceback, answered INTERNAL."""
    if isinstance(error, EmbedError):
        return error
    log.error("unexpected error in %s", method, exc_info=error)
    return Internal(f"internal error ({type(error).__name__}); the server log has the details")


@dataclass(frozen=True)
class ModelInfo:
    model_id: str
    model_version: str
    dim: int
    max_input_length: int
    execution_provider: str
    precision: str
    version: str


class ServingState:
    """What the servicer needs to know about the server's life: ready, draining.

    Draining does not refuse requests here: every request that reached the server is served, and
    gRPC's own stop() refuses new calls at the transport (see EmbeddingServer.stop).
    """

    def __init__(self) -> None:
        self.pipeline: Pipeline | None = None
        self.info: ModelInfo | None = None
        self.draining = False
        self.in_flight = 0  # RPCs inside a handler now; drain waits for this to reach 0

    def ready_pipeline(self) -> Pipeline:
        if self.pipeline is None:
            raise NotReady("the model is still loading; retry shortly")
        return self.pipeline


def to_response(result: Embedded, total_seconds: float) -> embedding_pb2.EmbedResponse:
    return embedding_pb2.EmbedResponse(
        embeddings=[embedding_pb2.Embedding(values=row) for row in result.embeddings.tolist()],
        token_counts=result.token_counts,
        total_tokens=sum(result.token_counts),
        truncated_inputs=result.truncated,
        timings=embedding_pb2.Timings(
            tokenization_seconds=result.tokenize_seconds,
            queue_seconds=result.queue_seconds,
            inference_seconds=result.inference_seconds,
            total_seconds=total_seconds,
        ),
    )


class EmbedderService(embedding_pb2_grpc.EmbedderServicer):
    def __init__(
        self,
        state: ServingState,
        metrics: Metrics,
        batching: embedding_pb2.InfoResponse,
        max_streams: int = 64,
        max_concurrent_rpcs: int = 512,
    ) -> None:
        self.state = state
        self.metrics = metrics
        self._batching = batching  # the limits part of Info, fixed at start
        self._max_streams = max_streams
        self._max_concurrent_rpcs = max_concurrent_rpcs
        self._open_streams = 0

    @contextlib.contextmanager
    def _observe(self, method: str, context: grpc.aio.ServicerContext) -> Iterator[list[grpc.StatusCode]]:
        """Counts the RPC with the code the handler records (OK unless it says otherwise)."""
        code = [grpc.StatusCode.OK]
        started = time.perf_counter()
        self.metrics.in_flight.inc()
        self.state.in_flight += 1
        try:
            yield code
        except asyncio.CancelledError:  # the client went away, or its deadline passed while we worked
            remaining = context.time_remaining()
            expired = remaining is not None and remaining <= 0
            code[0] = grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.CANCELLED
            self.metrics.rejected("deadline" if expired else "cancelled")
            raise
        except BaseException:
            if code[0] == grpc.StatusCode.OK:  # escaped every handler: gRPC answers UNKNOWN, so count that
                code[0] = grpc.StatusCode.UNKNOWN
            raise
        finally:
            self.state.in_flight -= 1
            self.metrics.in_flight.dec()
            self.metrics.requests.labels(method, code[0].name).inc()
            self.metrics.request_duration.labels(method).observe(time.perf_counter() - started)

    async def _embed(self, request: embedding_pb2.EmbedRequest, context: grpc.aio.ServicerContext) -> Embedded:
        if isinstance(request, MalformedRequest):
            raise InvalidInput(request.message)
        if self.state.in_flight > self._max_concurrent_rpcs:  # counts this one too
            raise Overloaded(f"more than {self._max_concurrent_rpcs} requests in progress; retry later")
        pipeline = self.state.ready_pipeline()
        remaining = context.time_remaining()
        deadline = time.monotonic() + remaining if remaining is not None else None
        normalize = request.normalize if request.HasField("normalize") else True
        # The message's own sequence, not a list copy: with truncation on, only cut prefixes are kept.
        return await pipeline.embed(request.inputs, request.truncate, normalize, deadline)

    def _failed(self, error: Exception, method: str, code: list[grpc.StatusCode]) -> EmbedError:
        """Any failure as the client gets it: records its status code and refusal reason."""
        domain = as_domain_error(error, method)
        code[0] = status_for(domain)
        self._reject(domain)
        return domain

    def _reject(self, error: EmbedError) -> None:
        """Counts a refusal once, by reason (a failed batch is counted as a batch failure instead)."""
        reason = REJECTION_REASON.get(type(error))
        if isinstance(error, NotReady) and not self.state.draining:
            reason = "not_ready"
        if reason is not None:
            self.metrics.rejected(reason)

    async def Embed(
        self, request: embedding_pb2.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> embedding_pb2.EmbedResponse:
        with self._observe("Embed", context) as code:
            started = time.perf_counter()
            try:
                result = await self._embed(request, context)
                return to_response(result, time.perf_counter() - started)
            except Exception as e:
                error = self._failed(e, "Embed", code)
                await context.abort(code[0], str(error))
                raise AssertionError("unreachable: abort raises") from None

    async def EmbedStream(
        self, request_iterator: AsyncIterator[embedding_pb2.EmbedRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[embedding_pb2.EmbedResponse]:
        """Requests are computed concurrently (up to STREAM_WINDOW) and answered in order."""
        if self._open_streams >= self._max_streams:
            self.metrics.rejected("overloaded")
            self.metrics.requests.labels("EmbedStream", grpc.StatusCode.RESOURCE_EXHAUSTED.name).inc()
            await context.abort(
                status_for(Overloaded("")), f"{self._open_streams} streams open, the limit; retry later"
            )
        self._open_streams += 1
        # The semaphore bounds the requests computing at once; a task is created only once it holds a
        # place, so a stream cancelled while its reader waits for room leaves no task behind.
        window = asyncio.Semaphore(STREAM_WINDOW)
        pending: asyncio.Queue[asyncio.Task[embedding_pb2.EmbedResponse] | None] = asyncio.Queue()

        async def one(request: embedding_pb2.EmbedRequest) -> embedding_pb2.EmbedResponse:
            with self._observe("EmbedStream", context) as code:
                started = time.perf_counter()
                try:
                    return to_response(await self._embed(request, context), time.perf_counter() - started)
                except Exception as e:
                    raise self._failed(e, "EmbedStream", code) from None

        async def read() -> None:
            try:
                async for request in request_iterator:
                    await window.acquire()
                    pending.put_nowait(asyncio.create_task(one(request)))
            finally:
                pending.put_nowait(None)

        reader = asyncio.create_task(read())
        position = 0
        try:
            while (task := await pending.get()) is not None:
                try:
                    response = await task
                except EmbedError as e:
                    await context.abort(status_for(e), f"stream request {position}: {e}")
                window.release()
                yield response
                position += 1
            await reader  # surfaces a failure to read the stream
        finally:
            self._open_streams -= 1
            reader.cancel()
            while not pending.empty():
                task = pending.get_nowait()
                if task is not None:
                    task.cancel()

    async def Info(
        self, request: embedding_pb2.InfoRequest, context: grpc.aio.ServicerContext
    ) -> embedding_pb2.InfoResponse:
        with self._observe("Info", context) as code:
            try:
                return self._info(request)
            except Exception as e:
                error = self._failed(e, "Info", code)
                await context.abort(code[0], str(error))
                raise AssertionError("unreachable: abort raises") from None

    def _info(self, request: embedding_pb2.InfoRequest) -> embedding_pb2.InfoResponse:
        if isinstance(request, MalformedRequest):
            raise InvalidInput(request.message)
        info = self.state.info
        if info is None:
            raise NotReady("the model is still loading; retry shortly")
        response = embedding_pb2.InfoResponse()
        response.CopyFrom(self._batching)
        response.model_id = info.model_id
        response.model_version = info.model_version
        response.dim = info.dim
        response.max_input_length = info.max_input_length
        response.execution_provider = info.execution_provider
        response.precision = info.precision
        response.version = info.version
        return response
