"""The HTTP/1.1 connection beneath the API (server/api/http/connection.py): header deadline, head size, bytes that
are not HTTP, the drain, one write per response."""

from __future__ import annotations

import asyncio
import json
import select
import socket
import time
from pathlib import Path

import httpx

from server.api.http.connection import HEAD_METHOD
from tests.conftest import ServerThread, counter, eventually, read_response, server_config


def test_slow_headers_time_out_with_408_and_the_connection_closes(tiny_artifacts: Path) -> None:
    server = ServerThread(server_config(tiny_artifacts, http_header_timeout_seconds=0.5))
    try:
        port = server.server.http_port
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\n")  # the headers never end
            started = time.monotonic()
            answer = read_response(sock)
            assert sock.recv(1) == b""  # closed after the answer
        assert answer.startswith("HTTP/1.1 408") and "did not arrive within 0.5 s" in answer, answer
        assert time.monotonic() - started < 5
        with socket.create_connection(("127.0.0.1", port), timeout=10) as idle:  # sends nothing at all
            assert read_response(idle).startswith("HTTP/1.1 408")
        assert unread_requests(server, "408") == 2  # counted as the clients got them
        # A request whose headers arrive in time is served on the same server.
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
    finally:
        server.stop()


def test_a_request_head_over_the_limit_gets_431_and_is_never_buffered_whole(served: ServerThread) -> None:
    """httptools buffers a header until it ends: without a limit one connection held 129 MiB of a header
    before the header timeout cut it. Heads of common sizes (a long bearer token, cookies) still pass."""
    from server.api.http.connection import MAX_HEAD_BYTES

    port = served.server.http_port
    before = unread_requests(served, "431")
    headers = {"X-Pad": "p" * 16_000}
    assert httpx.post(f"http://127.0.0.1:{port}/v1/embeddings", json={"input": "x"}, headers=headers).status_code == 200
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: a\r\nX-Big: ")
        sent = 0
        # One piece at a time until the answer comes: the server has then read all that was sent, and closes
        # cleanly (a close with unread bytes would reset the connection, and the answer with it).
        while not select.select([sock], [], [], 0.05)[0]:
            assert sent < 50 * MAX_HEAD_BYTES, f"{sent} bytes of one header and no answer"
            sock.sendall(b"x" * 16384)
            sent += 16384
        answer = read_response(sock)
    assert answer.startswith("HTTP/1.1 431"), answer[:200]
    assert sent < MAX_HEAD_BYTES + 512 * 1024  # the limit, and at most the read the head began in
    assert unread_requests(served, "431") == before + 1  # operators see it: embed_requests_total{code="431"}
    error = json.loads(answer.partition("\r\n\r\n")[2])["error"]
    assert error["code"] == "request_headers_too_large" and f"{MAX_HEAD_BYTES // 1024} KiB" in error["message"]


def unread_requests(server: ServerThread, code: str) -> float:
    """Requests answered before their head was read, with this status."""
    labels = {"protocol": "http", "method": HEAD_METHOD, "code": code, "model": ""}
    return server.server.metrics.registry.get_sample_value("embed_requests_total", labels) or 0.0


def test_bytes_that_are_not_http_get_a_json_error_not_the_frameworks_page(served: ServerThread) -> None:
    before = unread_requests(served, "400")
    for garbage in (b"GARBAGE\r\n\r\n", b"POST /v1/embeddings HTTP/1.1\r\nHost: a\r\nContent-Length: abc\r\n\r\n"):
        with socket.create_connection(("127.0.0.1", served.server.http_port), timeout=10) as sock:
            sock.sendall(garbage)
            answer = read_response(sock)
            assert sock.recv(1) == b""  # closed after the answer
        head, _, body = answer.partition("\r\n\r\n")
        assert head.startswith("HTTP/1.1 400") and "content-type: application/json" in head.lower(), answer
        error = json.loads(body)["error"]
        assert error["type"] == "invalid_request_error" and "not valid HTTP/1.1" in error["message"]
    assert unread_requests(served, "400") == before + 2


def test_the_drain_closes_kept_alive_connections_and_serves_a_request_half_received_when_it_ends(
    tiny_artifacts: Path,
) -> None:
    server = ServerThread(server_config(tiny_artifacts, drain_delay_seconds=0.3))
    port = server.server.http_port
    body = json.dumps({"input": "sent in two parts"}).encode()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\n")  # half the headers, before the drain
            stopping = asyncio.run_coroutine_threadsafe(server.server.stop(5.0), server.loop)
            eventually(lambda: server.server.state.draining, what="the drain")
            during = httpx.post(f"http://127.0.0.1:{port}/v1/embeddings", json={"input": "x"})
            # Served, and the client is told not to send on this connection again: its next request opens
            # a new one while the server is still in rotation, instead of racing the close at the drain's end.
            assert during.status_code == 200 and during.headers["connection"] == "close", during.headers

            def refused() -> bool:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                except ConnectionRefusedError:
                    return True
                return False

            eventually(refused, what="the HTTP listener closed at the end of the drain delay")
            sock.sendall(b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
            answer = read_response(sock)
            assert answer.startswith("HTTP/1.1 200") and '"embedding"' in answer, answer[:300]
            assert sock.recv(1) == b""  # then closed
        stopping.result(30)
    finally:
        server.loop.call_soon_threadsafe(server.loop.stop)


class RecordingTransport(asyncio.Transport):
    """A connection that records what the protocol writes to it."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        self.closed = False

    def get_extra_info(self, name: str, default: object = None) -> object:
        return {"sockname": ("127.0.0.1", 8080), "peername": ("127.0.0.1", 50000)}.get(name, default)

    def write(self, data: bytes) -> None:  # type: ignore[override]
        self.writes.append(bytes(data))

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def served_by_the_protocol(*requests: bytes) -> list[bytes]:
    """What the server's HTTP protocol writes on one connection for these requests, each answered by an app
    that reads the body and sends a head and a body, as the API does."""
    import uvicorn
    from uvicorn.server import ServerState

    from server.api.http.connection import protocol_class

    async def app(scope, receive, send) -> None:  # type: ignore[no-untyped-def]
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(body))]})
        await send({"type": "http.response.body", "body": body})

    async def serve() -> list[bytes]:
        config = uvicorn.Config(app, http="httptools", lifespan="off", access_log=False)
        config.load()
        protocol = protocol_class(10.0)(config=config, server_state=ServerState(), app_state={})
        transport = RecordingTransport()
        protocol.connection_made(transport)
        for data in requests:
            answered = len(transport.writes)
            protocol.data_received(data)
            for _ in range(1000):  # every request ends in "!", so its response does
                if len(transport.writes) > answered and transport.writes[-1].endswith(b"!"):
                    break
                await asyncio.sleep(0.01)
            else:
                raise AssertionError(f"no response within 10 s to {data!r}: {transport.writes}")
        protocol.connection_lost(None)
        return transport.writes

    return asyncio.run(serve())


def test_only_the_responses_head_is_held_never_a_later_body_write() -> None:
    from server.api.http.connection import OneWriteResponses

    transport = RecordingTransport()
    writes = OneWriteResponses(transport)
    writes.write(b"HTTP/1.1 200 OK\r\n\r\n")
    writes.write(b"part one, ")
    writes.write(b"HTTP/1.1 starts this part of the body")  # streamed: must leave now, not wait for a write
    assert transport.writes == [b"HTTP/1.1 200 OK\r\n\r\npart one, ", b"HTTP/1.1 starts this part of the body"]


def test_a_response_leaves_in_one_write_and_100_continue_at_once() -> None:
    """uvicorn writes a response's head and its body separately: two sends, two wake-ups of the client."""
    plain = b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Length: 6\r\n\r\nhello!"
    expecting = b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 3\r\n\r\nhi!"
    writes = served_by_the_protocol(plain, expecting)
    assert len(writes) == 3, writes
    assert writes[0].startswith(b"HTTP/1.1 200 OK\r\n") and writes[0].endswith(b"\r\n\r\nhello!")
    assert writes[1] == b"HTTP/1.1 100 Continue\r\n\r\n"
    assert writes[2].startswith(b"HTTP/1.1 200 OK\r\n") and writes[2].endswith(b"\r\n\r\nhi!")


class StalledConnection:
    """A connection as UnsentAnswers sees it: the memory its answer holds, the bytes its client has not taken."""

    def __init__(self, held: int, unsent: int) -> None:
        self.held, self.unsent, self.closed = held, unsent, False

    def held_bytes(self, unsent: int) -> int:
        return self.held

    def unsent_bytes(self) -> int:
        return self.unsent

    def close_unread(self) -> None:
        self.closed = True


def test_a_client_that_takes_no_byte_for_the_send_timeout_is_closed_and_a_slow_reader_is_kept() -> None:
    from server.api.http.connection import UnsentAnswers
    from server.metrics import Metrics

    async def scenario() -> None:  # a running loop for the sweep's timer; the sweeps here are called by hand
        metrics = Metrics()
        unsent = UnsentAnswers(send_timeout=10.0, metrics=metrics)
        idle, reading = StalledConnection(4_000_000, 3_000_000), StalledConnection(4_000_000, 3_000_000)
        unsent.stalled(idle, 0.0)  # type: ignore[arg-type]
        unsent.stalled(reading, 0.0)  # type: ignore[arg-type]
        for second in range(1, 30):
            reading.unsent -= 100_000  # 100 kB a second: slower than the timeout is long, never idle that long
            unsent.sweep(float(second))
            assert idle.closed == (second >= 10), second
        assert not reading.closed
        assert counter(metrics.http_slow_readers_closed, "send_timeout") == 1
        assert unsent.held_bytes == 4_000_000  # the reader's answer, held until it is taken
        unsent.taken(reading)  # type: ignore[arg-type]
        assert unsent.held_bytes == 0

    asyncio.run(scenario())


def test_past_their_memory_share_the_slowest_readers_go_first_and_none_stalled_within_the_grace() -> None:
    from server.api.http.connection import STALL_GRACE_SECONDS, UnsentAnswers
    from server.metrics import Metrics

    async def scenario() -> None:
        metrics = Metrics()
        unsent = UnsentAnswers(send_timeout=60.0, capacity=13_000_000, metrics=metrics)
        idle, slow, fast = (StalledConnection(6_000_000, 5_000_000) for _ in range(3))
        for connection in (fast, idle, slow):  # the fast reader stalled first: the order is by rate, not age
            unsent.stalled(connection, 0.0)  # type: ignore[arg-type]
        slow.unsent -= 500_000  # 1 MB/s over the next half second
        fast.unsent -= 2_000_000  # 4 MB/s
        unsent.sweep(0.5)
        assert not any(c.closed for c in (idle, slow, fast))  # 18 MB held, but each stalled within the grace
        young = StalledConnection(6_000_000, 5_000_000)
        unsent.stalled(young, 0.6)  # type: ignore[arg-type]
        unsent.sweep(STALL_GRACE_SECONDS)
        # 24 MB held against 13: the idle one goes, then the slow one; the young one (nothing taken either) is
        # within the grace, and the fast reader's 6 MB with it fit.
        assert [c.closed for c in (idle, slow, fast, young)] == [True, True, False, False]
        assert unsent.held_bytes == 12_000_000 and counter(metrics.http_slow_readers_closed, "budget") == 2

    asyncio.run(scenario())


def embeddings_request(inputs: int) -> bytes:
    body = json.dumps({"input": ["a word"] * inputs}).encode()
    head = b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
    return head % len(body) + body


def test_a_client_that_stops_reading_gets_nothing_more_computed_and_is_closed_after_the_send_timeout(
    tiny_artifacts: Path,
) -> None:
    """A client that sends requests and does not read the answers (decisions/0021): its connection stalls on an
    answer, nothing more is read or computed for it
    (uvicorn would compute the next pipelined request and hold that answer too), and it is closed once no byte
    has been taken for the send timeout."""
    server = ServerThread(server_config(tiny_artifacts, http_send_timeout_seconds=1.0))
    try:
        unsent, metrics = server.server.unsent, server.server.metrics
        with socket.create_connection(("127.0.0.1", server.server.http_port), timeout=10) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.sendall(embeddings_request(2048) * 12)  # about 0.8 MB an answer: more than the socket buffers
            eventually(lambda: unsent.held_bytes > 0, what="an answer the client has not taken, held by the server")
            [connection] = list(unsent._stalls)
            eventually(lambda: not connection.tasks, what="no request running on the stalled connection")
            assert connection.flow.read_paused
            answered = counter(metrics.requests, "POST /v1/embeddings", "200")
            assert answered < 12
            eventually(lambda: counter(metrics.http_slow_readers_closed, "send_timeout") == 1, what="closed")
            assert unsent.held_bytes == 0
            assert counter(metrics.requests, "POST /v1/embeddings", "200") == answered  # nothing more computed
            received = b""
            try:
                while chunk := sock.recv(1 << 20):
                    received += chunk
            except ConnectionResetError:  # the server dropped what the client had not taken
                pass
            assert received.count(b"HTTP/1.1 200") <= answered
    finally:
        server.stop()


def test_a_client_reading_slowly_but_steadily_gets_every_answer_whole(tiny_artifacts: Path) -> None:
    """The send timeout counts time without a byte taken, not the time an answer takes."""
    server = ServerThread(server_config(tiny_artifacts, http_send_timeout_seconds=0.5))
    try:
        unsent = server.server.unsent
        requests = 5
        with socket.create_connection(("127.0.0.1", server.server.http_port), timeout=10) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
            sock.sendall(embeddings_request(2048) * requests)
            eventually(lambda: unsent.held_bytes > 0, what="a stalled answer")
            started, received = time.monotonic(), b""
            while received.count(b"HTTP/1.1 200") < requests or not received.endswith(b"}"):
                chunk = sock.recv(64 * 1024)
                assert chunk, f"closed after {len(received)} bytes"
                received += chunk
                time.sleep(0.02)  # at most 64 KiB every 20 ms: 3.3 MB/s
            took = time.monotonic() - started
        answers = received.split(b"HTTP/1.1 200 OK\r\n")[1:]
        assert len(answers) == requests
        for answer in answers:
            assert len(json.loads(answer.partition(b"\r\n\r\n")[2])["data"]) == 2048
        assert took > 2 * 0.5  # longer than the send timeout, without a pause that long
        assert counter(server.server.metrics.http_slow_readers_closed) == 0
    finally:
        server.stop()
