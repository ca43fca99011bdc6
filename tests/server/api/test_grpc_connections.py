"""A gRPC connection whose client stops taking its answers: for how long it holds its calls' places.

gRPC counts a call in `--max-concurrent-rpcs` until its answer has left, and its core has no send timeout: a
client that leaves its HTTP/2 windows at 0 keeps every call it started for as long as it keeps the connection.
The client here is raw HTTP/2 (h2), the only way to hold a window at 0 on purpose.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import grpc
import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
import pytest

from embedding.v1 import embedding_pb2, embedding_pb2_grpc
from tests.conftest import ServerThread, eventually, request, server_config


class ClientThatTakesNoAnswer:
    """Starts `calls` Embed calls on one connection and never opens its streams' windows.

    The server can send each call's headers, never its message; the client answers the server's pings and
    settings, and keeps its socket open until the server closes it."""

    def __init__(self, port: int, calls: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        windows_shut = {h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0, h2.settings.SettingCodes.ENABLE_PUSH: 0}
        self.h2.local_settings = h2.settings.Settings(client=True, initial_values=windows_shut)
        self.h2.initiate_connection()
        body = request("a river").SerializeToString()
        message = b"\x00" + len(body).to_bytes(4, "big") + body  # gRPC's framing: not compressed, length, bytes
        for _ in range(calls):
            stream = self.h2.get_next_available_stream_id()
            headers = [(":method", "POST"), (":scheme", "http"), (":path", "/embedding.v1.Embedder/Embed"),
                       (":authority", f"127.0.0.1:{port}"), ("content-type", "application/grpc"),
                       ("te", "trailers")]  # fmt: skip
            self.h2.send_headers(stream, headers)
            self.h2.send_data(stream, message, end_stream=True)
        self.sock.sendall(self.h2.data_to_send())
        self.answered = 0  # calls whose answer began (its headers came) and cannot go on
        self.closed = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                data = self.sock.recv(65536)
            except OSError:
                break
            if not data:
                break
            try:
                events = self.h2.receive_data(data)
            except h2.exceptions.ProtocolError:
                continue  # after the server's GOAWAY; the socket stays open, as a client that never reads keeps it
            self.answered += sum(isinstance(e, h2.events.ResponseReceived) for e in events)
            try:
                self.sock.sendall(self.h2.data_to_send())  # acknowledgements of the server's settings and pings
            except OSError:
                break
        self.closed.set()

    def close(self) -> None:
        self.sock.close()


def answered(stub: embedding_pb2_grpc.EmbedderStub) -> bool:
    """True if a call is answered, False if it is refused for want of a place."""
    try:
        return len(stub.Embed(request("a river"), timeout=10).embeddings) == 1
    except grpc.RpcError as e:
        if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
            raise
        return False


def test_past_its_age_and_grace_a_connection_that_takes_no_answer_is_closed_and_its_places_come_back(
    tiny_artifacts,  # type: ignore[no-untyped-def]
) -> None:
    config = server_config(
        tiny_artifacts,
        max_concurrent_rpcs=4,
        # Long enough for the refusal below to come first on a busy machine; the test takes their sum.
        grpc_max_connection_age_seconds=2.0,
        grpc_max_connection_age_grace_seconds=1.0,
    )
    server = ServerThread(config)
    stalled = ClientThatTakesNoAnswer(server.port, calls=4)
    try:
        eventually(lambda: stalled.answered == 4, what="4 calls answered and stuck")
        with grpc.insecure_channel(server.target) as channel:
            stub = embedding_pb2_grpc.EmbedderStub(channel)
            with pytest.raises(grpc.RpcError) as refused:
                stub.Embed(request("a river"), timeout=10)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # every place held
            eventually(stalled.closed.is_set, what="the stalled connection closed by the server")
            eventually(lambda: answered(stub), what="a call answered once the stalled connection's places came back")
    finally:
        stalled.close()
        server.stop()


def test_a_stream_still_running_past_its_connections_age_and_grace_is_cut_unavailable_after_its_answers(
    tiny_artifacts,  # type: ignore[no-untyped-def]
) -> None:
    """The grace's cost, as docs/api.md states it: a stream that outlives the age and the grace ends UNAVAILABLE,
    the answers it got before standing."""
    config = server_config(
        tiny_artifacts, grpc_max_connection_age_seconds=0.5, grpc_max_connection_age_grace_seconds=0.5
    )
    server = ServerThread(config)

    def slowly(n: int) -> Iterator[embedding_pb2.EmbedRequest]:
        for i in range(n):
            time.sleep(0.1)
            yield request(f"text {i}")

    answers: list[int] = []
    try:
        with grpc.insecure_channel(server.target) as channel:
            stub = embedding_pb2_grpc.EmbedderStub(channel)
            with pytest.raises(grpc.RpcError) as cut:
                for response in stub.EmbedStream(slowly(60), timeout=30):  # 6 s of requests
                    answers.append(len(response.embeddings))
        assert cut.value.code() == grpc.StatusCode.UNAVAILABLE, cut.value.details()
        assert 0 < len(answers) < 60 and set(answers) == {1}, answers
    finally:
        server.stop()
