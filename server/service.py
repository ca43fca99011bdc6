"""The gRPC servicer: the only module that knows protobuf, and the one table of error -> status code."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from embedding.v1 import embedding_pb2, embedding_pb2_grpc
from server.admission import Admission, Ticket
from server.errors import (
    BodyTooLarge,
    Cancelled,
    DeadlineExceeded,
    EmbedError,
    InferenceFailed,
    Internal,
    InvalidInput,
    NotReady,
    Overloaded,
    Unauthenticated,
    UnknownModel,
    nearest_entry,
)
from server.metrics import Metrics
from server.models import ModelInfo, ServedModel, ServingState
from server.pipeline import Embedded
from server.request_ids import REQUEST_ID, RequestIds

log = logging.getLogger(__name__)
SERVICE_NAME = embedding_pb2.DESCRIPTOR.services_by_name["Embedder"].full_name

# The one translation table from domain errors to gRPC status codes (docs/api.md, "Status codes").
STATUS_FOR_ERROR: dict[type[EmbedError], grpc.StatusCode] = {
    InvalidInput: grpc.StatusCode.INVALID_ARGUMENT,
    UnknownModel: grpc.StatusCode.INVALID_ARGUMENT,
    BodyTooLarge: grpc.StatusCode.RESOURCE_EXHAUSTED,  # as gRPC answers a message over its size limit
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
    UnknownModel: "invalid",
    BodyTooLarge: "invalid",
    Overloaded: "overloaded",
    NotReady: "draining",
    DeadlineExceeded: "deadline",
    Cancelled: "cancelled",
}

DESCRIBED_FIELDS = (
    "model_id",
    "model_version",
    "dim",
    "max_input_length",
    "execution_provider",
    "precision",
    "max_batch_tokens",
)
STREAM_WINDOW = 16  # requests of one stream computed concurrently; reading pauses beyond that


class Received:
    """A request as the handler gets it: the parsed message with its admission tickets (its call's
    place and its body's bytes), or the reason it was not parsed (malformed, or refused unparsed).

    The handler takes the message out and drops it once tokenized, and releases the tickets then:
    a request waiting for its batch holds only its token rows.
    """

    __slots__ = ("_message", "error", "tickets")

    def __init__(self, message: Any = None, error: EmbedError | None = None, ticket: Ticket | None = None) -> None:
        self._message = message
        self.error = error
        self.tickets = [ticket] if ticket else []

    def take(self) -> Any:
        """The message (once), or the error that stopped it from being parsed."""
        if self.error is not None:
            raise self.error
        message, self._message = self._message, None
        return message

    def release(self) -> None:
        for ticket in self.tickets:
            ticket.release()


def _release(received: Received, _done: object) -> None:
    """A done callback: gives back what a request's task held, whether the task ran or not."""
    received.release()


def receiving(parse: Callable[[bytes], Any], admission: Admission) -> Callable[[bytes], Received]:
    """A request deserializer that admits the body's bytes before parsing them.

    Malformed bytes become INVALID_ARGUMENT (gRPC's own failure would be UNKNOWN with a traceback in
    the log); a body over the byte budget is refused RESOURCE_EXHAUSTED without being parsed.
    """

    def deserialize(data: bytes) -> Received:
        try:
            ticket = admission.receive(len(data))
        except Overloaded as e:
            return Received(error=e)
        try:
            return Received(parse(data), ticket=ticket)
        except DecodeError as e:
            ticket.release()
            return Received(error=InvalidInput(f"malformed request: {e}"))

    return deserialize


def add_to_server(service: EmbedderService, server: grpc.aio.Server, admission: Admission) -> None:
    """Like the generated add_EmbedderServicer_to_server, with every body admitted before it is parsed.

    Embed is registered request-streaming (the wire is the same as a unary call's): gRPC reads a unary
    call's message before any handler code runs, so only this way can the handler admit the call by
    its connection first and refuse it unread (``RpcAccounting._admitted``).
    """
    pb = embedding_pb2
    handlers = {
        "Embed": grpc.stream_unary_rpc_method_handler(
            service.Embed, receiving(pb.EmbedRequest.FromString, admission), pb.EmbedResponse.SerializeToString
        ),
        "EmbedStream": grpc.stream_stream_rpc_method_handler(
            service.EmbedStream,
            receiving(pb.EmbedRequest.FromString, admission),
            pb.EmbedResponse.SerializeToString,
        ),
        "Info": grpc.unary_unary_rpc_method_handler(
            service.Info, receiving(pb.InfoRequest.FromString, admission), pb.InfoResponse.SerializeToString
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


def status_for(error: EmbedError) -> grpc.StatusCode:
    return nearest_entry(STATUS_FOR_ERROR, error, grpc.StatusCode.INTERNAL)  # type: ignore[no-any-return]


def as_domain_error(error: Exception, method: str) -> EmbedError:
    """A domain error as it is; anything else is a bug: logged with its traceback, answered INTERNAL."""
    if isinstance(error, EmbedError):
        return error
    log.error("unexpected error in %s", method, exc_info=error)
    return Internal(f"internal error ({type(error).__name__}); the server log has the details")


@functools.cache
def _row_prefix(dim: int) -> bytes:
    """The bytes before a row's floats in a serialized EmbedResponse: the same for every row of a width.

    Taken from protobuf's own serialization of one zero row (its floats are the last 4 x dim bytes).
    """
    one_row = embedding_pb2.EmbedResponse(embeddings=[embedding_pb2.Embedding(values=[0.0] * dim)])
    return one_row.SerializeToString()[: -4 * dim]


def embeddings_message(embeddings: np.ndarray) -> embedding_pb2.EmbedResponse:
    """An EmbedResponse holding these (n, dim) rows, parsed from their wire format.

    A repeated float field is packed little-endian float32 on the wire, so each row is a fixed prefix
    and its array's bytes: no Python float per value (12 us a row of 128 that way; 6 us for 8 rows
    this way).
    """
    rows = np.ascontiguousarray(embeddings, dtype="<f4")
    if len(rows) == 0:
        return embedding_pb2.EmbedResponse()
    prefix = _row_prefix(rows.shape[1])
    return embedding_pb2.EmbedResponse.FromString(prefix + prefix.join([row.tobytes() for row in rows]))


def to_response(result: Embedded, total_seconds: float, model: str) -> embedding_pb2.EmbedResponse:
    response = embeddings_message(result.embeddings)
    response.model = model
    response.token_counts.extend(result.token_counts)
    response.total_tokens = sum(result.token_counts)
    response.truncated_inputs.extend(result.truncated)
    timings = response.timings
    timings.tokenization_seconds = result.tokenize_seconds
    timings.queue_seconds = result.queue_seconds
    timings.inference_seconds = result.inference_seconds
    timings.total_seconds = total_seconds
    return response


def deadline_of(context: grpc.aio.ServicerContext) -> float | None:
    """The call's deadline on time.monotonic's clock (the batcher's), or None when it has none."""
    remaining = context.time_remaining()
    return time.monotonic() + remaining if remaining is not None else None


def describe(info: ModelInfo, message: Any) -> None:
    """The fields InfoResponse and ModelDescription share, from one model's info."""
    for field in DESCRIBED_FIELDS:
        setattr(message, field, getattr(info, field))


@dataclass
class Call:
    """What an RPC's accounting records: the status code it ended with and the model it used, and the
    connection it came on."""

    code: grpc.StatusCode = grpc.StatusCode.OK
    model: str = ""  # "" until the request named a model that exists
    # The client's address (context.peer()), read once when the RPC starts: peer() calls into gRPC's core on
    # the call without checking that the RPC still runs, and a stream's requests run on tasks of their own
    # that can start after the client cancelled it (a server died there with SIGSEGV: docs/reliability.md).
    client: str = ""


class RpcAccounting:
    """Counting, admission by RPCs in progress and error translation, shared by both protocols."""

    def __init__(self, state: ServingState, metrics: Metrics, admission: Admission) -> None:
        self.state = state
        self.metrics = metrics
        self.admission = admission
        self._request_ids = RequestIds()

    async def _refuse(
        self, context: grpc.aio.ServicerContext, method: str, code: grpc.StatusCode, details: str
    ) -> NoReturn:
        """Ends a failed call with its status. Its trailing metadata carries the request id (the caller's
        ``x-request-id``, else one made here), which an INTERNAL's log line names: a caller's report leads to
        the log. Only failures pay for it."""
        given = next((v for k, v in context.invocation_metadata() or () if k == REQUEST_ID), None)
        request_id = self._request_ids(given.encode() if isinstance(given, str) else given).decode()
        if code == grpc.StatusCode.INTERNAL:
            log.warning("%s answered INTERNAL to request %s: %s", method, request_id, details)
        try:
            await context.abort(code, details, trailing_metadata=((REQUEST_ID, request_id),))
        except grpc.aio.InternalError as e:
            # gRPC's core ended the call first (the client cancelled, or its deadline passed while the status
            # was on its way), so no status can be sent. grpc.aio logs this error with a traceback unless it has
            # already seen the client close; a cancellation it logs at debug level.
            raise asyncio.CancelledError(f"{method}: the call ended before its status could be sent") from e
        raise AssertionError("unreachable: abort raises")

    @contextlib.contextmanager
    def _observe(self, method: str, context: grpc.aio.ServicerContext) -> Iterator[Call]:
        """Counts the RPC with the code the handler records (OK unless it says otherwise)."""
        call = Call()
        started = time.perf_counter()
        self.state.request_started()
        try:
            yield call
        except asyncio.CancelledError:  # the client went away, or its deadline passed while we worked
            if call.code == grpc.StatusCode.OK:  # else the call had failed, and was counted, before it ended
                remaining = context.time_remaining()
                expired = remaining is not None and remaining <= 0
                call.code = grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.CANCELLED
                self.metrics.rejected("deadline" if expired else "cancelled", call.model)
            raise
        except BaseException:
            if call.code == grpc.StatusCode.OK:  # escaped every handler: gRPC answers UNKNOWN, so count that
                call.code = grpc.StatusCode.UNKNOWN
            raise
        finally:
            self.state.request_finished()
            self.metrics.answered("grpc", method, call.code.name, call.model, time.perf_counter() - started)

    def _admit(self, request: Any, call: Call, name_field: str = "model") -> ServedModel:
        """The model a request names, served and loaded (calls in progress and bytes are bounded before
        the request is parsed: gRPC's maximum_concurrent_rpcs and ``receiving``)."""
        model = self.state.resolve(getattr(request, name_field))
        call.model = model.name
        return model

    async def _unary(
        self,
        method: str,
        received: Received,
        context: grpc.aio.ServicerContext,
        work: Callable[[Call], Awaitable[Any]],
    ) -> Any:
        """One unary RPC: counted, its body's bytes released, any failure answered with its status code."""
        with self._observe(method, context) as call:
            try:
                return await work(call)
            except Exception as e:
                error = self._failed(e, method, call)
                await self._refuse(context, method, call.code, str(error))
            finally:
                received.release()

    async def _admitted(
        self,
        method: str,
        context: grpc.aio.ServicerContext,
        work: Callable[[Call, Received], Awaitable[Any]],
    ) -> Any:
        """A unary call registered request-streaming: admitted by its connection, then its one message read.

        Refused (RESOURCE_EXHAUSTED) before a byte of its body is read when the calls in progress are
        full; the work releases the tickets once it no longer needs the body.
        """
        with self._observe(method, context) as call:
            place: Ticket | None = None
            received: Received | None = None
            try:
                call.client = context.peer()  # before the first await: the RPC is still running
                place = self.admission.enter(call.client)
                read = await context.read()
                if read is grpc.aio.EOF:
                    raise InvalidInput("the call carried no request message")
                received = read
                received.tickets.append(place)
                return await work(call, received)
            except Exception as e:
                error = self._failed(e, method, call)
                await self._refuse(context, method, call.code, str(error))
            finally:
                # Also when the client leaves while its message is awaited (CancelledError): a ticket left
                # to the garbage collector may be held for minutes inside a reference cycle.
                if received is not None:
                    received.release()
                elif place is not None:
                    place.release()

    def _failed(self, error: Exception, method: str, call: Call) -> EmbedError:
        """Any failure as the client gets it: records its status code and refusal reason."""
        domain = as_domain_error(error, method)
        call.code = status_for(domain)
        self._reject(domain, call.model)
        return domain

    def _reject(self, error: EmbedError, model: str) -> None:
        """Counts a refusal once, by reason (a failed batch is counted as a batch failure instead)."""
        reason = nearest_entry(REJECTION_REASON, error)
        if isinstance(error, NotReady) and not self.state.draining:
            reason = "not_ready"
        if reason is not None:
            self.metrics.rejected(reason, model)


class EmbedderService(RpcAccounting, embedding_pb2_grpc.EmbedderServicer):
    def __init__(
        self,
        state: ServingState,
        metrics: Metrics,
        batching: embedding_pb2.InfoResponse,
        admission: Admission,
        max_streams: int = 64,
    ) -> None:
        super().__init__(state, metrics, admission)
        self._batching = batching  # the limits part of Info, fixed at start
        self._max_streams = max_streams
        self._open_streams = 0

    async def _embed(
        self, received: Received, context: grpc.aio.ServicerContext, call: Call
    ) -> embedding_pb2.EmbedResponse:
        request = received.take()
        model = self._admit(request, call)
        started = time.perf_counter()
        deadline = deadline_of(context)
        normalize = request.normalize if request.HasField("normalize") else True
        dimensions = request.dimensions if request.HasField("dimensions") else None
        client = call.client
        # The message's own sequence, not a list copy: with truncation on, only cut prefixes are kept.
        tokenized = await model.pipeline.tokenize(request.inputs, request.truncate, client)
        del request  # only the token rows wait for the batch: the body's memory and places go now
        received.release()
        result = await model.pipeline.compute(tokenized, normalize, deadline, client, dimensions)
        response = to_response(result, time.perf_counter() - started, model.name)
        if dimensions is not None:
            response.dimensions_trained = model.info.trained_at(dimensions)
        return response

    async def Embed(
        self, requests: AsyncIterator[Received], context: grpc.aio.ServicerContext
    ) -> embedding_pb2.EmbedResponse:
        return await self._admitted("Embed", context, lambda call, received: self._embed(received, context, call))

    async def EmbedStream(
        self, request_iterator: AsyncIterator[Received], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[embedding_pb2.EmbedResponse]:
        """Requests are computed concurrently (up to STREAM_WINDOW) and answered in order."""
        client = context.peer()  # before the first await: the RPC is still running (Call.client)
        if self._open_streams >= self._max_streams:
            self.metrics.rejected("overloaded")
            self.metrics.requests.labels("grpc", "EmbedStream", grpc.StatusCode.RESOURCE_EXHAUSTED.name, "").inc()
            details = f"{self._open_streams} streams open, the limit; retry later"
            await self._refuse(context, "EmbedStream", status_for(Overloaded("")), details)
        self._open_streams += 1
        # The semaphore bounds the requests computing at once; a task is created only once it holds a
        # place, so a stream cancelled while its reader waits for room leaves no task behind.
        window = asyncio.Semaphore(STREAM_WINDOW)
        pending: asyncio.Queue[asyncio.Task[embedding_pb2.EmbedResponse] | None] = asyncio.Queue()

        async def one(received: Received) -> embedding_pb2.EmbedResponse:
            with self._observe("EmbedStream", context) as call:
                call.client = client
                try:
                    return await self._embed(received, context, call)
                except Exception as e:
                    raise self._failed(e, "EmbedStream", call) from None

        async def read() -> None:
            try:
                async for request in request_iterator:
                    try:
                        await window.acquire()
                    except BaseException:  # the stream ends while this request waits for room: its body goes
                        request.release()
                        raise
                    task = asyncio.create_task(one(request))
                    # Released when the task is done, also when it is cancelled before it starts (the stream
                    # ended): then one() never runs, and its body would wait for the garbage collector.
                    task.add_done_callback(functools.partial(_release, request))
                    pending.put_nowait(task)
            finally:
                pending.put_nowait(None)

        reader = asyncio.create_task(read())
        position = 0
        try:
            while (task := await pending.get()) is not None:
                try:
                    response = await task
                except EmbedError as e:
                    await self._refuse(context, "EmbedStream", status_for(e), f"stream request {position}: {e}")
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

    async def Info(self, received: Received, context: grpc.aio.ServicerContext) -> embedding_pb2.InfoResponse:
        return await self._unary("Info", received, context, lambda call: self._info(received.take(), call))

    async def _info(self, request: embedding_pb2.InfoRequest, call: Call) -> embedding_pb2.InfoResponse:
        info = self.state.resolve(request.model).info
        call.model = info.name
        response = embedding_pb2.InfoResponse(model=info.name, version=info.version)
        response.MergeFrom(self._batching)
        describe(info, response)
        for i, model in enumerate(self.state.models.values()):
            description = response.models.add(name=model.name, is_default=i == 0)
            describe(model.info, description)
            description.trained_dimensions.extend(model.info.trained_dimensions)
        return response

    def set_limits(self, limits: embedding_pb2.InfoResponse) -> None:
        """The serving limits Info reports, once the memory plan is known (after loading)."""
        self._batching = limits
