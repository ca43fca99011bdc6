"""The HTTP/1.1 connection under the API: uvicorn's httptools protocol with a deadline on each request's
headers, a bound on their size, errors in OpenAI's shape where uvicorn answers plain text, a drain that
answers every request whose first bytes have arrived, and one write per response."""

from __future__ import annotations

import asyncio
from http import HTTPStatus

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from server.errors import EmbedError, InvalidInput, nearest_entry
from server.http import REASON_FOR_ERROR, HeadersTimedOut, HeadTooLarge, error_body
from server.metrics import Metrics

# A request's line and headers, the most read (nginx reads 32 KiB, h11 16 KiB): a bearer token and cookies fit.
MAX_HEAD_BYTES = 64 * 1024
HEAD_METHOD = "(request head)"  # the method label of a request answered before its head was read (408, 431, 400)


class ServingProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a deadline on each request's headers, and a drain that answers
    every request whose first bytes have arrived.

    uvicorn bounds only the idle time between requests: a client that connects and sends its headers a
    byte at a time, or nothing, would hold its connection and socket forever (slowloris). The clock
    starts when the connection opens or a request's first byte arrives, and stops when its headers are
    complete; the body has its own timeout (``HttpApi.body_timeout``). Late headers get 408 and the
    connection is closed. A head over MAX_HEAD_BYTES gets 431 and is closed too (httptools would hold a
    header of any size until it ended), and bytes that are not HTTP/1.1 get 400: every answer in OpenAI's
    error shape, where uvicorn would answer plain text.

    uvicorn's shutdown closes every connection without a request whose headers are complete: a request
    half-received at that moment would be lost. Here it is served, and then the connection closes.

    uvicorn writes a response's head and body in two writes, two sends on the socket; each request's cycle
    writes through ``OneWriteResponses`` instead, so a response leaves in one.
    """

    header_timeout = 10.0  # seconds; set per server by ``protocol_class``
    metrics: Metrics | None = None  # likewise: where a request answered before its head was read is counted
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
        if self._close_after_request:
            self.cycle.keep_alive = False
        if self.scope["method"] != "HEAD":  # a HEAD response has no body write to send the head with
            self.cycle.transport = OneWriteResponses(self.transport)  # type: ignore[assignment]

    def shutdown(self) -> None:
        if self._receiving_headers:
            self._close_after_request = True  # the header timeout still bounds how long this can take
        else:
            super().shutdown()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

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

    __slots__ = ("_head", "_head_sent", "_transport")

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._head = b""
        self._head_sent = False  # after it every write is body: passed on as it comes

    def write(self, data: bytes) -> None:
        if self._head:
            data, self._head, self._head_sent = self._head + data, b"", True
        elif not self._head_sent and data.startswith(b"HTTP/1.1 ") and not data.startswith(b"HTTP/1.1 100 "):
            self._head = data
            return
        self._transport.write(data)

    def close(self) -> None:
        if self._head:  # a response that failed after its head: the head goes out, as uvicorn sends it
            self._transport.write(self._head)
            self._head = b""
        self._transport.close()

    def is_closing(self) -> bool:
        return self._transport.is_closing()


def protocol_class(header_timeout: float, metrics: Metrics | None = None) -> type[ServingProtocol]:
    """The protocol class uvicorn instantiates per connection, with this server's header timeout and metrics."""
    return type("ServingProtocol", (ServingProtocol,), {"header_timeout": header_timeout, "metrics": metrics})
