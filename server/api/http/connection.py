"""The HTTP/1.1 connection under the API: uvicorn's httptools protocol with a deadline on each request's
headers, a bound on their size, errors in OpenAI's shape where uvicorn answers plain text, a drain that
answers every request whose first bytes have arrived, one write per response, a bound on the answers
waiting for clients that do not read them, and the requests of a client that leaves cancelled."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import socket
import struct
import termios
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, cast

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from server.api.http.app import (
    CONNECTION,
    REASON_FOR_ERROR,
    ConnectionRequests,
    HeadersTimedOut,
    HeadTooLarge,
    error_body,
)
from server.core.errors import EmbedError, InvalidInput, nearest_entry
from server.metrics import Metrics

log = logging.getLogger(__name__)

# A request's line and headers, the most read (nginx reads 32 KiB, h11 16 KiB): a bearer token and cookies fit.
MAX_HEAD_BYTES = 64 * 1024
HEAD_METHOD = "(request head)"  # the method label of a request answered before its head was read (408, 431, 400)


class ServingProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with what uvicorn leaves out: a deadline on each request's headers (408) and
    a bound on their size (431), OpenAI's error shape for bytes that are not HTTP/1.1 (400), a drain that
    answers a request half-received when it starts, one write per response (``OneWriteResponses``), the
    requests of a lost connection cancelled (``ConnectionRequests``), and nothing more read from a
    connection whose client has not taken its answer (``UnsentAnswers``). docs/api.md states each rule.
    """

    header_timeout = 10.0  # seconds; set per server by ``protocol_class``
    metrics: Metrics | None = None  # likewise: where a request answered before its head was read is counted
    unsent: UnsentAnswers | None = None  # likewise: answers not yet taken by their clients
    _next_request_waits = False  # an answer was completed while stalled: the next request starts when it is taken
    _writing = 0  # bytes of the last response write: what a stalled answer holds (see ``held_bytes``)
    _header_timer: asyncio.TimerHandle | None = None
    _head_started = 0.0
    _receiving_headers = False
    _close_after_request = False
    _head_bytes = 0  # of the request head being received, after the read it began in

    def data_received(self, data: bytes) -> None:
        # httptools holds a header until it ends, so a head is bounded here, by the reads that follow the one it
        # began in (that read's share of it is not known, and is at most one read: no pipelined request is
        # refused for the body before it).
        receiving = self._receiving_headers
        super().data_received(data)
        if receiving and self._receiving_headers:
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES and not self.transport.is_closing():
                self._refuse(HeadTooLarge(f"the request line and headers are over {MAX_HEAD_BYTES // 1024} KiB"))

    def send_400_response(self, msg: str) -> None:
        """Bytes httptools cannot parse as HTTP/1.1: OpenAI's error shape, where uvicorn answers plain text."""
        self._refuse(InvalidInput("the request is not valid HTTP/1.1"))

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._requests = ConnectionRequests()
        self._arm_header_timer()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._receiving_headers = True
        self._head_bytes = 0
        if self._header_timer is None:  # a new request on a kept-alive connection
            self._arm_header_timer()

    def on_headers_complete(self) -> None:
        self._cancel_header_timer()
        self._receiving_headers = False
        previous = self.cycle
        super().on_headers_complete()
        if self.cycle is None or self.cycle is previous:  # no new request cycle (an upgrade refused)
            return
        cast(dict[str, Any], self.cycle.scope)[CONNECTION] = self._requests  # a key of ours, not ASGI's
        if self._close_after_request:
            self.cycle.keep_alive = False
        if self.scope["method"] != "HEAD":  # a HEAD response has no body write to send the head with
            self.cycle.transport = OneWriteResponses(self.transport, self)  # type: ignore[assignment]

    def on_message_complete(self) -> None:
        super().on_message_complete()
        # The whole body is in. uvicorn stops reading the socket past 64 KiB of body and leaves it so while the
        # request runs: a client that left would not be noticed (ConnectionRequests). Read on, unless uvicorn
        # or this class holds reading back on purpose (a pipelined request queued, an answer not yet taken).
        if not (self.cycle.response_complete or self.pipeline or self._next_request_waits or self.flow.write_paused):
            self.flow.resume_reading()

    def shutdown(self) -> None:
        if self._receiving_headers:
            self._close_after_request = True  # the header timeout still bounds how long this can take
        else:
            super().shutdown()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        self._requests.lose()  # the client is gone: its running requests are cancelled, their queued inputs swept
        if self.unsent is not None:
            self.unsent.taken(self)
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self.unsent is not None:
            self.unsent.stalled(self, self.loop.time())

    def resume_writing(self) -> None:
        super().resume_writing()
        if self.unsent is not None:
            self.unsent.taken(self)
        if self._next_request_waits:
            self._next_request_waits = False
            super().on_response_complete()  # reads again, starts a pipelined request or arms keep-alive

    def on_response_complete(self) -> None:
        if self.flow.write_paused and not self.transport.is_closing():
            self._next_request_waits = True
            self.flow.pause_reading()
            return
        super().on_response_complete()

    def unsent_bytes(self) -> int:
        """Bytes of this connection's answers the client has not taken: the transport's buffer and, on Linux, the
        socket's send queue (sent bytes not yet acknowledged, and bytes not sent). The transport's buffer alone
        moves only when the kernel's queue, megabytes deep, has room: a client reading steadily would look idle."""
        return self.transport.get_write_buffer_size() + self._kernel_unsent()

    def _kernel_unsent(self) -> int:
        sock = self.transport.get_extra_info("socket")
        if sock is None or not hasattr(termios, "TIOCOUTQ"):
            return 0
        try:
            return int(struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0])
        except OSError:  # closed meanwhile
            return 0

    def held_bytes(self, unsent: int) -> int:
        """The memory a stalled answer holds, given its ``unsent_bytes``: in the process the whole write, not only
        its unsent part (uvloop's write context keeps the written object until its last byte leaves), and in the
        kernel the socket's send queue (which the container's memory limit counts too)."""
        return unsent + max(0, self._writing - self.transport.get_write_buffer_size())

    def close_unread(self) -> None:
        """Close at once, dropping what the client has not taken: ``close`` would wait for it to read, and even
        after ``abort`` the kernel goes on offering the socket's send queue to a client that takes nothing, for
        minutes, unless the socket lingers for 0 s (a reset instead of a close)."""
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.transport.abort()

    def _arm_header_timer(self) -> None:
        self._head_started = self.loop.time()
        self._header_timer = self.loop.call_later(self.header_timeout, self._headers_late)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self._refuse(HeadersTimedOut(f"the request headers did not arrive within {self.header_timeout:g} s"))

    def _refuse(self, error: EmbedError) -> None:
        """Answers a request that never reached the app, in OpenAI's error shape, and closes the connection."""
        self._cancel_header_timer()
        status, body = error_body(error)
        if self.metrics is not None:
            self.metrics.answered("http", HEAD_METHOD, str(status), "", self.loop.time() - self._head_started)
            self.metrics.rejected(nearest_entry(REASON_FOR_ERROR, error) or "invalid")
        head = b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\nconnection: close\r\n" % (
            status,
            HTTPStatus(status).phrase.encode(),
        )
        self.transport.write(head + b"content-length: %d\r\n\r\n" % len(body) + body)
        self.transport.close()


class OneWriteResponses:
    """A request cycle's view of its connection: the response's head is held until the body's first write and
    sent with it, so the response leaves in one send (one system call, and one wake-up of the client, instead
    of two). A "100 Continue" goes out at once: the client waits for it before sending the body.
    """

    __slots__ = ("_connection", "_head", "_head_sent", "_transport")

    def __init__(self, transport: asyncio.Transport, connection: ServingProtocol | None = None) -> None:
        self._transport = transport
        self._connection = connection  # told each write's size before it is made (a stall is reported within it)
        self._head = b""
        self._head_sent = False  # after it every write is body: passed on as it comes

    def write(self, data: bytes) -> None:
        if self._head:
            data, self._head, self._head_sent = self._head + data, b"", True
        elif not self._head_sent and data.startswith(b"HTTP/1.1 ") and not data.startswith(b"HTTP/1.1 100 "):
            self._head = data
            return
        if self._connection is not None:
            self._connection._writing = len(data)
        self._transport.write(data)

    def close(self) -> None:
        if self._head:  # a response that failed after its head: the head goes out, as uvicorn sends it
            self._transport.write(self._head)
            self._head = b""
        self._transport.close()

    def is_closing(self) -> bool:
        return self._transport.is_closing()


SWEEP_SECONDS = 0.25  # how often stalled connections are checked, while there are any
# A connection stalled for less than this is never closed for the answers' budget: a client on a slow link takes a
# large answer over a second or so. The budget's overshoot is then at most what the server answers in this long.
STALL_GRACE_SECONDS = 1.0
LOG_EVERY_SECONDS = 60.0  # closed connections are logged at most this often (a slow reader chooses how many)


@dataclass(eq=False)
class _Stall:
    since: float  # when the connection stalled
    held: int  # the memory its answer holds until the client has taken it (ServingProtocol.held_bytes)
    unsent_then: int  # bytes its client had not taken then
    unsent: int  # at the last check
    taken_at: float  # when its client last took bytes (or since)


class UnsentAnswers:
    """Answers written to HTTP connections and not yet taken by their clients, bounded two ways.

    A client that stops reading leaves its answer in the server's memory, and one that keeps sending requests
    on new connections can grow that without end (decisions/0021). So, checked every SWEEP_SECONDS while any
    connection is stalled:

    * a connection whose client takes none of its bytes for ``send_timeout`` seconds is closed;
    * while the stalled connections hold more than ``capacity`` bytes (the memory plan's share for them), those
      stalled for at least STALL_GRACE_SECONDS are closed, the slowest reader first (bytes taken per second
      since it stalled; the longest stalled first among equals), until they hold no more than it.

    A closed connection's answer is dropped: its client was not reading it.
    """

    def __init__(self, send_timeout: float, capacity: int = 0, metrics: Metrics | None = None) -> None:
        self.send_timeout = send_timeout
        self.capacity = capacity  # bytes; 0 = no budget (before the memory plan is made)
        self._metrics = metrics
        self._stalls: dict[ServingProtocol, _Stall] = {}  # in the order they stalled
        # Their stalls' ``held``, summed: one int, which the metrics thread reads while the event loop changes it.
        self._held = 0
        self._timer: asyncio.TimerHandle | None = None
        self._closed = {"send_timeout": 0, "budget": 0}  # since the last log line
        self._logged_at = float("-inf")

    @property
    def held_bytes(self) -> int:
        return self._held

    def stalled(self, connection: ServingProtocol, now: float) -> None:
        self.taken(connection)  # asyncio pairs each pause with a resume; never count one connection twice
        unsent = connection.unsent_bytes()
        stall = self._stalls[connection] = _Stall(now, connection.held_bytes(unsent), unsent, unsent, now)
        self._held += stall.held
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(SWEEP_SECONDS, self._tick)

    def taken(self, connection: ServingProtocol) -> None:
        """The client has taken its answer (or the connection is gone)."""
        stall = self._stalls.pop(connection, None)
        if stall is not None:
            self._held -= stall.held

    def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        self.sweep(loop.time())
        self._timer = loop.call_later(SWEEP_SECONDS, self._tick) if self._stalls else None

    def sweep(self, now: float) -> None:
        """Close what the send timeout and the budget say must go."""
        for connection, stall in list(self._stalls.items()):
            left = connection.unsent_bytes()
            if left < stall.unsent:
                stall.unsent, stall.taken_at = left, now
            if now - stall.taken_at >= self.send_timeout:
                self._close(connection, "send_timeout", now)
        if not self.capacity or self._held <= self.capacity:
            return

        def taken_per_second(connection: ServingProtocol) -> float:
            stall = self._stalls[connection]
            return (stall.unsent_then - stall.unsent) / (now - stall.since)

        closable = [c for c, stall in self._stalls.items() if now - stall.since >= STALL_GRACE_SECONDS]
        for connection in sorted(closable, key=taken_per_second):  # stable: the longest stalled first among equals
            if self._held <= self.capacity:
                break
            self._close(connection, "budget", now)

    def _close(self, connection: ServingProtocol, reason: str, now: float) -> None:
        self.taken(connection)
        connection.close_unread()
        if self._metrics is not None:
            self._metrics.http_slow_readers_closed.labels(reason).inc()
        self._closed[reason] += 1
        if now - self._logged_at >= LOG_EVERY_SECONDS:
            log.warning(
                "closed HTTP connections whose clients were not taking their answers: %d for the send timeout "
                "(%g s without a byte taken), %d for the memory their answers held (%d bytes at most); "
                "counted in embed_http_slow_readers_closed_total, logged at most every %g s",
                self._closed["send_timeout"],
                self.send_timeout,
                self._closed["budget"],
                self.capacity,
                LOG_EVERY_SECONDS,
            )
            self._closed = dict.fromkeys(self._closed, 0)
            self._logged_at = now


def protocol_class(
    header_timeout: float, metrics: Metrics | None = None, unsent: UnsentAnswers | None = None
) -> type[ServingProtocol]:
    """The protocol class uvicorn instantiates per connection, with this server's header timeout, metrics and
    bound on answers not yet taken."""
    attributes = {"header_timeout": header_timeout, "metrics": metrics, "unsent": unsent}
    return type("ServingProtocol", (ServingProtocol,), attributes)
