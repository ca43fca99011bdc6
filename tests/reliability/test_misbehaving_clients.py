"""Clients misbehaving in every way at once, with the garbage collector off: afterwards the server answers,
and nothing of theirs is still held (admission budgets, requests in flight, the queue)."""

from __future__ import annotations

import gc
import json
import random
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator

import grpc

from embedding.v1 import embedding_pb2, embedding_pb2_grpc
from server.core.admission import Ticket
from tests.conftest import ServerThread, eventually, request, server_config

SECONDS = 6.0
WORDS = ("river", "a dog", "breathe", "photosynthesis", "caf\u00e9", "\u2603")


def text(rnd: random.Random) -> str:
    return " ".join(rnd.choice(WORDS) for _ in range(rnd.randint(1, 60)))


def streams_cancelled(server: ServerThread, rnd: random.Random, until: float, seen: Counter[str]) -> None:
    """Streams cancelled after 0-3 answers, or left to their 1 ms - 1 s deadlines; some connections closed."""
    channel = grpc.insecure_channel(server.target)
    stub = embedding_pb2_grpc.EmbedderStub(channel)
    while time.monotonic() < until:
        done = threading.Event()

        def requests(done: threading.Event) -> Iterator[embedding_pb2.EmbedRequest]:
            for _ in range(rnd.randint(1, 60)):
                yield request(*[text(rnd)] * rnd.randint(1, 4), truncate=True)
            done.wait(rnd.random())

        try:
            call = stub.EmbedStream(requests(done), timeout=rnd.choice([0.001, 0.05, 1.0]))
            for _ in range(rnd.randint(0, 3)):
                next(call)
            call.cancel()
            seen["stream cancelled"] += 1
        except grpc.RpcError as e:
            seen[f"stream {e.code().name}"] += 1
        except StopIteration:
            seen["stream ended"] += 1
        finally:
            done.set()
        if rnd.random() < 0.1:
            channel.close()
            channel = grpc.insecure_channel(server.target)
            stub = embedding_pb2_grpc.EmbedderStub(channel)
    channel.close()


def calls_abandoned(server: ServerThread, rnd: random.Random, until: float, seen: Counter[str]) -> None:
    """Embed calls cancelled at once or after a few ms, or given 1-100 ms deadlines; some out of range."""
    channel = grpc.insecure_channel(server.target)
    stub = embedding_pb2_grpc.EmbedderStub(channel)
    while time.monotonic() < until:
        message = request(*[text(rnd) for _ in range(rnd.randint(1, 64))], truncate=True)
        if rnd.random() < 0.2:
            message.dimensions = rnd.choice([16, 10_000])
        try:
            future = stub.Embed.future(message, timeout=rnd.choice([0.001, 0.01, 0.1, 2.0]))
            if rnd.random() < 0.3:
                time.sleep(rnd.random() * 0.01)
                future.cancel()
            future.result()
            seen["embed OK"] += 1
        except grpc.FutureCancelledError:
            seen["embed cancelled"] += 1
        except grpc.RpcError as e:
            seen[f"embed {e.code().name}"] += 1
    channel.close()


def http_abandoned(server: ServerThread, rnd: random.Random, until: float, seen: Counter[str]) -> None:
    """Bodies cut short, answers never read, bytes that are not HTTP, and some requests served."""
    while time.monotonic() < until:
        body = json.dumps({"input": [text(rnd) for _ in range(rnd.choice([1, 65, 300]))], "model": ""}).encode()
        head = f"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
        with socket.create_connection(("127.0.0.1", server.server.http_port), timeout=10) as connection:
            kind = rnd.randrange(4)
            if kind == 0:
                connection.sendall(head.encode() + body[: rnd.randrange(len(body))])
                seen["http body cut"] += 1
            elif kind == 1:
                connection.sendall(head.encode() + body)
                time.sleep(rnd.random() * 0.02)
                seen["http left before its answer"] += 1
            elif kind == 2:
                connection.sendall(head.encode() + body)
                seen[f"http {connection.recv(12)[9:12].decode()}"] += 1
            else:
                connection.sendall(b"NOT HTTP \x00\xff\r\n\r\n")
                seen[f"http garbage {connection.recv(12)[9:12].decode()}"] += 1


def test_misbehaving_clients_leave_nothing_held_and_the_server_answering(
    tiny_artifacts, finalised_while_held: list[Ticket]
) -> None:
    server = ServerThread(server_config(tiny_artifacts, http_body_timeout_seconds=1.0, http_header_timeout_seconds=1.0))
    seen: Counter[str] = Counter()
    clients: list[Callable[[ServerThread, random.Random, float, Counter[str]], None]] = [
        streams_cancelled, calls_abandoned, http_abandoned
    ] * 3  # fmt: skip
    gc.disable()
    try:
        until = time.monotonic() + SECONDS
        threads = [
            threading.Thread(target=client, args=(server, random.Random(i), until, seen))
            for i, client in enumerate(clients)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(SECONDS + 30)
        assert not any(thread.is_alive() for thread in threads), "a client did not finish"
        served = server.server
        admission, batcher = served.admission, served.state.resolve("").batcher
        # Cut bodies wait out the 1 s body timeout; everything else is already over.
        eventually(lambda: served.state.in_flight == 0, what="no request in flight")
        eventually(lambda: (admission.calls, admission.held_bytes) == (0, 0), what="the admission budgets empty")
        assert batcher.queued_items == 0 and batcher.queued_tokens == 0
        assert not finalised_while_held
        assert len(server.stub().Embed(request("still answering"), timeout=10).embeddings) == 1
        # Every kind of misbehaviour happened.
        assert seen["stream cancelled"] and seen["embed cancelled"] and seen["embed DEADLINE_EXCEEDED"]
        assert seen["http body cut"] and seen["http left before its answer"] and seen["http 200"]
    finally:
        gc.enable()
        server.stop()
