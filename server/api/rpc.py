"""What both gRPC services share: the table of domain error -> status code, admission of each call and its
body before parsing, counting, and request ids on failures."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc
from google.protobuf.message import DecodeError

from server.api.request_ids import REQUEST_ID, RequestIds
from server.core.admission import Admission, Ticket
from server.core.errors import (
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
from server.core.registry import ServedModel, ServingState
from server.metrics import Metrics

log = logging.getLogger(__name__)

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


def release_when_done(received: Received, _done: object) -> None:
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


def status_for(error: EmbedError) -> grpc.StatusCode:
    return nearest_entry(STATUS_FOR_ERROR, error, grpc.StatusCode.INTERNAL)  # type: ignore[no-any-return]


def as_domain_error(error: Exception, method: str) -> EmbedError:
    """A domain error as it is; anything else is a bug: logged with its traceback, answered INTERNAL."""
    if isinstance(error, EmbedError):
        return error
    log.error("unexpected error in %s", method, exc_info=error)
    return Internal(f"internal error ({type(error).__name__}); the server log has the details")


def deadline_of(context: grpc.aio.ServicerContext) -> float | None:
    """The call's deadline on time.monotonic's clock (the batcher's), or None when it has none."""
    remaining = context.time_remaining()
    return time.monotonic() + remaining if remaining is not None else None


@dataclass
class Call:
    """What an RPC's accounting records: the status code it ended with and the model it used, and the
    connection it came on."""

    code: grpc.StatusCode = grpc.StatusCode.OK
    model: str = ""  # "" until the request named a model that exists
    # The client's address (context.peer()), read once when the RPC starts: peer() calls into gRPC's core on
    # the call without checking that the RPC still runs, and a stream's requests run on tasks of their own
    # that can start after the client cancelled it (a server died there with SIGSEGV).
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
