"""End-to-end over real gRPC sockets against a tiny exported model."""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Iterator

import grpc
import numpy as np
import psutil
import pytest
from grpc._cython.cygrpc import ExecuteBatchError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from client import AsyncEmbeddingClient, EmbeddingClient
from embedding.v1 import embedding_pb2, embedding_pb2_grpc
from server.api.grpc import STREAM_WINDOW, embeddings_message
from server.core.admission import Ticket
from server.core.tokenizer import TextTokenizer
from tests.conftest import (
    GENERATED_ID,
    SENTENCES,
    GatedBackend,
    PeerAtStartOnly,
    ServerThread,
    counter,
    eventually,
    request,
    requests_by_code,
    server_config,
)

LONG_TEXT = " ".join(["photosynthesis of the chlorophyll"] * 20)  # far beyond the tiny model's 32 tokens


def vectors(response: embedding_pb2.EmbedResponse) -> np.ndarray:
    return np.array([e.values for e in response.embeddings], dtype=np.float32)


def unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


@pytest.mark.parametrize("dim", [1, 31, 32, 128, 384, 5000])  # 1- to 3-byte length prefixes
@pytest.mark.parametrize("rows", [0, 1, 5])
def test_embeddings_built_from_wire_bytes_equal_protobufs_own(dim: int, rows: int) -> None:
    embeddings = np.random.default_rng(dim).normal(size=(rows, 2 * dim)).astype(np.float32)[:, ::2]  # strided
    if rows:
        embeddings[0, 0] = -0.0
    built = embeddings_message(embeddings)
    expected = embedding_pb2.EmbedResponse(embeddings=[embedding_pb2.Embedding(values=r) for r in embeddings])
    assert built == expected
    assert built.SerializeToString() == expected.SerializeToString()
    np.testing.assert_array_equal(vectors(built).reshape(embeddings.shape), embeddings)


def test_embed_returns_inputs_in_order_equal_to_onnx_alone(served: ServerThread, reference) -> None:
    response = served.stub().Embed(request(*SENTENCES, truncate=True))
    got = vectors(response)
    assert got.shape == (len(SENTENCES), 32)
    for i, text in enumerate(SENTENCES):
        np.testing.assert_allclose(got[i], unit(reference(text)), atol=1e-5)
    assert response.token_counts[5] == 3  # [CLS] x [SEP]
    assert response.token_counts[2] == 32  # truncated to the tiny model's limit
    assert response.total_tokens == sum(response.token_counts)
    assert response.timings.total_seconds >= response.timings.inference_seconds > 0


def test_normalize_defaults_to_true_and_can_be_turned_off(served: ServerThread, reference) -> None:
    stub = served.stub()
    default = vectors(stub.Embed(request("the cat sat on the mat")))
    raw = vectors(stub.Embed(request("the cat sat on the mat", normalize=False)))
    assert np.linalg.norm(default[0]) == pytest.approx(1.0, abs=1e-6)
    assert abs(np.linalg.norm(raw[0]) - 1.0) > 1e-3
    np.testing.assert_allclose(raw[0], reference("the cat sat on the mat"), atol=1e-5)
    np.testing.assert_allclose(default[0], unit(raw[0]), atol=1e-6)


def test_truncate_on_cuts_to_the_limit_and_off_names_count_and_limit(served: ServerThread, reference) -> None:
    stub = served.stub()
    response = stub.Embed(request("short", LONG_TEXT, truncate=True))
    assert list(response.truncated_inputs) == [1]
    assert response.token_counts[1] == 32
    np.testing.assert_allclose(vectors(response)[1], unit(reference(LONG_TEXT, truncate=True)), atol=1e-5)
    with pytest.raises(grpc.RpcError) as error:
        stub.Embed(request("short", LONG_TEXT, truncate=False))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "inputs[1]" in error.value.details() and "limit of 32" in error.value.details()


@pytest.mark.parametrize(
    ("texts", "message"),
    [
        ((), "inputs is empty"),
        (("ok", ""), "inputs[1] is empty"),
        (("ok", "fine", "   "), "inputs[2] is empty"),
        (tuple(["word"] * 33), "33 inputs, more than max_client_batch_size=32"),
    ],
)
def test_invalid_requests_get_invalid_argument(served: ServerThread, texts: tuple[str, ...], message: str) -> None:
    with pytest.raises(grpc.RpcError) as error:
        served.stub().Embed(request(*texts))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in error.value.details()


def test_message_size_is_bounded(tiny_artifacts) -> None:
    server = ServerThread(server_config(tiny_artifacts, max_message_bytes=64 * 1024))
    try:
        with pytest.raises(grpc.RpcError) as error:
            server.stub().Embed(request("word " * 20000, truncate=True))
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert len(server.stub().Embed(request("still serving")).embeddings) == 1
    finally:
        server.stop()


@pytest.fixture
def filling(tiny_artifacts) -> Iterator[ServerThread]:
    """A server whose batches wait up to 50 ms to fill. The tiny model answers a text faster than the next
    request arrives, and a short batch with nothing queued runs at once on the event loop: left at once,
    a burst of concurrent requests was at times served one by one, leaving no batch to test."""
    served = ServerThread(server_config(tiny_artifacts, max_delay_ms=50.0))
    yield served
    served.stop()


def test_busy_mixed_length_batches_give_the_same_embeddings_as_alone(filling: ServerThread, reference) -> None:
    texts = [" ".join(SENTENCES[: 1 + i % len(SENTENCES)])[: 10 + 7 * i] for i in range(60)]

    async def run() -> list[np.ndarray]:
        async with AsyncEmbeddingClient(filling.target) as client:
            results = await asyncio.gather(*(client.embed([t], truncate=True) for t in texts))
        return [np.array(r.embeddings[0], dtype=np.float32) for r in results]

    got = asyncio.run(run())
    for text, vector in zip(texts, got, strict=True):
        np.testing.assert_allclose(vector, unit(reference(text)), atol=1e-5)
    assert counter(filling.server.metrics.batches) < len(texts)  # really batched


def test_200_concurrent_clients_each_get_their_own_result(filling: ServerThread, reference) -> None:
    texts = [f"client {i} asks about {SENTENCES[i % len(SENTENCES)]}" for i in range(200)]

    async def one(text: str) -> np.ndarray:
        async with AsyncEmbeddingClient(filling.target) as client:  # each its own channel
            result = await client.embed([text], truncate=True)
        return np.array(result.embeddings[0], dtype=np.float32)

    async def run() -> list[np.ndarray]:
        return await asyncio.gather(*(one(t) for t in texts))

    got = asyncio.run(run())
    for text, vector in zip(texts, got, strict=True):
        np.testing.assert_allclose(vector, unit(reference(text)), atol=1e-5)
    assert counter(filling.server.metrics.batches) < len(texts)  # they were batched together, not one by one


def test_stream_answers_in_order(served: ServerThread, reference) -> None:
    texts = [f"{SENTENCES[i % len(SENTENCES)]} number {i}" for i in range(40)]
    responses = list(served.stub().EmbedStream(iter([request(t, truncate=True) for t in texts])))
    assert len(responses) == len(texts)
    for text, response in zip(texts, responses, strict=True):
        np.testing.assert_allclose(vectors(response)[0], unit(reference(text)), atol=1e-5)


def test_stream_error_ends_the_stream_naming_the_request(served: ServerThread) -> None:
    requests = [request("fine"), request("also fine"), request(""), request("never reached")]
    got = []
    with pytest.raises(grpc.RpcError) as error:
        for response in served.stub().EmbedStream(iter(requests)):
            got.append(response)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "stream request 2" in error.value.details()
    assert len(got) == 2


def test_the_client_address_is_read_once_when_the_call_starts_never_from_a_request_running_later(
    served: ServerThread,
) -> None:
    service = served.server.service
    context = PeerAtStartOnly(request("a dog"))
    assert len(served.call(service.Embed(context.stream(), context)).embeddings) == 1  # type: ignore[arg-type]

    async def streamed(context: PeerAtStartOnly) -> list[embedding_pb2.EmbedResponse]:
        return [r async for r in service.EmbedStream(context.stream(), context)]  # type: ignore[arg-type]

    context = PeerAtStartOnly(*(request(f"text {i}") for i in range(3 * STREAM_WINDOW)))
    responses = served.call(streamed(context))
    assert [len(r.embeddings) for r in responses] == [1] * (3 * STREAM_WINDOW)


def test_connections_are_renewed_after_their_max_age_and_calls_on_them_finish(tiny_artifacts) -> None:  # type: ignore[no-untyped-def]
    """With --grpc-max-connection-age-seconds a client's channel moves to a new connection (where, balancing over
    DNS, it would find replicas added since), and a stream open across the age is not cut."""
    server = ServerThread(server_config(tiny_artifacts, grpc_max_connection_age_seconds=0.5))
    me = psutil.Process()

    def client_ports() -> set[int]:  # the server's end of each connection, in this process, by the client's port
        return {
            c.raddr.port
            for c in me.net_connections("tcp")
            if c.laddr.port == server.server.port and c.status == psutil.CONN_ESTABLISHED and c.raddr
        }

    try:
        channel = grpc.insecure_channel(server.target)
        stub = embedding_pb2_grpc.EmbedderStub(channel)

        def slowly(n: int) -> Iterator[embedding_pb2.EmbedRequest]:
            for i in range(n):
                time.sleep(0.1)
                yield request(f"text {i}")

        assert [len(r.embeddings) for r in stub.EmbedStream(slowly(15), timeout=30)] == [1] * 15  # 1.5 s, one stream
        seen: set[int] = set()
        started = time.monotonic()
        while len(seen) < 2:
            assert time.monotonic() - started < 10, f"one connection for 10 s: {seen}"
            assert len(stub.Embed(request("a river"), timeout=10).embeddings) == 1
            seen |= client_ports()
            time.sleep(0.05)
        channel.close()
    finally:
        server.stop()


class EndedByCore(PeerAtStartOnly):
    """A call that gRPC's core has already ended (the client cancelled, or its deadline passed) by the time
    the handler sends its status: grpc.aio's abort then fails as here, and grpc.aio logs that failure as an
    error with a traceback unless it has already seen the client close."""

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: object = ()) -> None:
        raise ExecuteBatchError('Failed "execute_batch": (SendStatusFromServerOperation,)')


async def raised(call: Awaitable[object]) -> BaseException | None:
    try:
        await call
    except BaseException as e:  # the outcome itself is under test, CancelledError included
        return e
    return None


def test_a_failed_call_that_ended_before_its_status_could_be_sent_ends_as_cancelled_and_is_counted_once(
    served: ServerThread,
) -> None:
    service, metrics = served.server.service, served.server.metrics
    served.settled()
    before = {reason: counter(metrics.rejections, reason) for reason in ("invalid", "cancelled", "deadline")}
    answered = counter(metrics.requests, "Embed", "INVALID_ARGUMENT")
    context = EndedByCore(request("   "))  # whitespace only: INVALID_ARGUMENT
    error = served.call(raised(service.Embed(context.stream(), context)))  # type: ignore[arg-type]
    # grpc.aio logs a CancelledError at debug level; the ExecuteBatchError would have been an ERROR.
    assert isinstance(error, asyncio.CancelledError) and isinstance(error.__cause__, ExecuteBatchError)

    async def streamed(context: EndedByCore) -> None:
        async for _ in service.EmbedStream(context.stream(), context):  # type: ignore[arg-type]
            pass

    context = EndedByCore(request("a dog"), request(""))
    error = served.call(raised(streamed(context)))
    assert isinstance(error, asyncio.CancelledError) and isinstance(error.__cause__, ExecuteBatchError)
    after = {reason: counter(metrics.rejections, reason) for reason in before}
    assert after == {**before, "invalid": before["invalid"] + 2}  # once each, as refused, never as cancelled
    assert counter(metrics.requests, "Embed", "INVALID_ARGUMENT") == answered + 1


def test_a_call_that_ends_while_its_body_waits_gives_its_admission_back_at_once(
    tiny_artifacts, finalised_while_held: list[Ticket]
) -> None:
    """Cancelled while the server awaits a unary call's message, or while a stream's next request waits for
    room in its window: the call's place and the request's bytes go back to the budgets then, by the path that
    took them, not whenever the garbage collector finds them (with a reference cycle, minutes later)."""
    server = ServerThread(server_config(tiny_artifacts))
    admission = server.server.admission
    gate = GatedBackend(server.server)
    no_more = threading.Event()
    gc.disable()
    try:
        channel = grpc.insecure_channel(server.target)
        embed = channel.stream_unary(  # Embed as registered: its message is read after the call is admitted
            "/embedding.v1.Embedder/Embed",
            request_serializer=embedding_pb2.EmbedRequest.SerializeToString,
            response_deserializer=embedding_pb2.EmbedResponse.FromString,
        )

        def message_never_sent() -> Iterator[embedding_pb2.EmbedRequest]:
            no_more.wait(30)
            yield from ()

        call = embed.future(message_never_sent())
        eventually(lambda: admission.calls == 1, what="the call admitted, its message awaited")
        call.cancel()
        eventually(lambda: admission.calls == 0, what="the cancelled call's place given back")

        def requests() -> Iterator[embedding_pb2.EmbedRequest]:
            for i in range(2 * STREAM_WINDOW):
                yield request(f"stream text {i}")
            no_more.wait(30)

        stream = server.stub().EmbedStream(requests())
        batcher = server.server.state.resolve("").batcher
        eventually(lambda: batcher.queued_items + gate.held >= STREAM_WINDOW, what="the stream's window filled")
        eventually(lambda: admission.held_bytes > 0, what="a request read and waiting for room")
        stream.cancel()
        eventually(lambda: server.server.service._open_streams == 0, what="the stream closed")
        eventually(lambda: admission.held_bytes == 0, what="the waiting request's bytes given back")
        assert admission.calls == 0
        assert not finalised_while_held
    finally:
        gc.enable()
        no_more.set()
        gate.release()
        server.stop()


def request_id(error: grpc.RpcError) -> str:
    return dict(error.trailing_metadata() or ())["x-request-id"]  # type: ignore[attr-defined]


def test_a_failed_call_carries_a_request_id_the_callers_own_when_it_sent_a_sane_one(served: ServerThread) -> None:
    stub = served.stub()
    ids = []
    for _ in range(2):
        with pytest.raises(grpc.RpcError) as refused:
            stub.Embed(request(""))
        ids.append(request_id(refused.value))
    assert all(GENERATED_ID.fullmatch(i) for i in ids) and ids[0] != ids[1]
    with pytest.raises(grpc.RpcError) as refused:
        stub.Embed(request(""), metadata=[("x-request-id", "gateway-42/7f3a:b")])
    assert request_id(refused.value) == "gateway-42/7f3a:b"
    with pytest.raises(grpc.RpcError) as refused:
        stub.Embed(request(""), metadata=[("x-request-id", "two words")])
    assert GENERATED_ID.fullmatch(request_id(refused.value))
    with pytest.raises(grpc.RpcError) as ended:  # a stream's failure too
        list(stub.EmbedStream(iter([request("fine"), request("")])))
    assert GENERATED_ID.fullmatch(request_id(ended.value))


def test_info_reports_model_limits_and_provider(served: ServerThread) -> None:
    with EmbeddingClient(served.target) as client:
        info = client.info()
    assert info["dim"] == 32 and info["max_input_length"] == 32
    assert info["execution_provider"] == "CPUExecutionProvider"
    assert info["max_client_batch_size"] == 32 and info["precision"] == "fp32"
    assert len(str(info["model_version"])) == 12


LONG_LIST = [f"text number {i} about rivers" if i not in (40, 65) else "word " * 60 for i in range(70)]


def test_the_client_sends_a_long_list_as_requests_of_the_servers_size(served: ServerThread) -> None:
    """70 texts where the server takes 32 a request: three requests, one result as if it were one."""
    requests = served.server.metrics.requests
    served.settled()
    before = counter(requests, "Embed", "OK")
    with EmbeddingClient(served.target) as client:
        result = client.embed(LONG_LIST, truncate=True)
        parts = [client.embed(LONG_LIST[start : start + 32], truncate=True) for start in (0, 32, 64)]
    served.settled()
    assert counter(requests, "Embed", "OK") - before == 6  # 3 for the list, 3 for its parts sent by hand
    assert result.embeddings == [e for part in parts for e in part.embeddings]
    assert result.token_counts == [c for part in parts for c in part.token_counts] and len(result.token_counts) == 70
    assert result.truncated_inputs == [40, 65]  # indices into the whole list


def test_the_asyncio_client_sends_a_long_list_in_parts_too(served: ServerThread) -> None:
    async def embed() -> tuple[list[list[float]], list[int]]:
        async with AsyncEmbeddingClient(served.target) as client:
            result = await client.embed(LONG_LIST, truncate=True)
        return result.embeddings, result.truncated_inputs

    embeddings, truncated = asyncio.run(embed())
    with EmbeddingClient(served.target) as client:
        assert embeddings == client.embed(LONG_LIST, truncate=True).embeddings and truncated == [40, 65]


def test_both_clients_take_one_string_as_one_text_not_as_its_characters(served: ServerThread) -> None:
    """A str is a Sequence[str] of its characters: ``embed("a river")`` must not embed seven one-letter texts."""

    async def embed_async() -> list[list[float]]:
        async with AsyncEmbeddingClient(served.target) as client:
            return (await client.embed("a river")).embeddings

    with EmbeddingClient(served.target) as client:
        one = client.embed("a river")
        assert one.embeddings == client.embed(["a river"]).embeddings and len(one.token_counts) == 1
    assert asyncio.run(embed_async()) == one.embeddings


def test_reflection_lists_the_services(served: ServerThread) -> None:
    stub = reflection_pb2_grpc.ServerReflectionStub(grpc.insecure_channel(served.target))
    (response,) = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    names = {s.name for s in response.list_services_response.service}
    assert {"embedding.v1.Embedder", "grpc.health.v1.Health"} <= names


def test_health_not_serving_until_loaded_then_serving_then_not_serving_on_drain(tiny_artifacts) -> None:
    server = ServerThread(server_config(tiny_artifacts), load=False)
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(server.target))

    def status(service: str = "") -> int:
        return health.Check(health_pb2.HealthCheckRequest(service=service)).status

    assert status() == health_pb2.HealthCheckResponse.NOT_SERVING
    with pytest.raises(grpc.RpcError) as error:
        server.stub().Embed(request("too early"))
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE
    server.call(server.server.load())
    assert status() == status("embedding.v1.Embedder") == health_pb2.HealthCheckResponse.SERVING
    watch = health.Watch(health_pb2.HealthCheckRequest(service=""))
    assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
    stopper = threading.Thread(target=server.stop, args=(2.0,))
    stopper.start()
    assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
    stopper.join()


def test_the_server_drops_a_request_for_its_deadline_and_never_computes_it(tiny_artifacts) -> None:
    server = ServerThread(server_config(tiny_artifacts))
    gate = GatedBackend(server.server)
    metrics = server.server.metrics
    stub = server.stub()
    try:
        blocker = stub.Embed.future(request("holds the backend"))
        eventually(lambda: gate.held == 1, what="the blocker's batch reached the gated backend")
        with pytest.raises(grpc.RpcError) as error:
            stub.Embed(request("too slow", "for me"), timeout=0.5)
        assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        # The server itself dropped both inputs for their deadline (not as a cancellation by gRPC), and
        # did so while the backend was still held, so they can never have been computed.
        eventually(lambda: counter(metrics.dropped_items, "deadline") == 2, what="dropped{reason=deadline} == 2")
        assert counter(metrics.dropped_items, "cancelled") == 0
        assert server.server.batcher.queued_items == 0
        # The handler records its answer just after the batcher failed the request: wait for it too.
        eventually(lambda: counter(metrics.requests, "Embed", "DEADLINE_EXCEEDED") == 1, what="counted once")
        gate.release()
        assert len(blocker.result().embeddings) == 1
        assert len(stub.Embed(request("after")).embeddings) == 1
        assert gate.batch_sizes == [1, 1]  # the blocker and "after"; nothing of the expired request
    finally:
        gate.release()
        server.stop()


def test_a_request_that_can_never_fit_the_queue_is_invalid_argument(tiny_artifacts) -> None:
    server = ServerThread(server_config(tiny_artifacts, max_queue_tokens=10))
    try:
        with pytest.raises(grpc.RpcError) as error:
            server.stub().Embed(request(*["a"] * 6))  # at least 6 x 2 tokens: more than the whole queue
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "split the request" in error.value.details()
        assert len(server.stub().Embed(request("a", "b")).embeddings) == 2  # 6 tokens fit
    finally:
        server.stop()


def test_max_input_chars_is_enforced_exactly(served: ServerThread) -> None:
    limit = 20_000  # ServerConfig's default, which the module server uses
    at_limit = ("word " * (limit // 5))[:limit]
    response = served.stub().Embed(request("ok", at_limit, truncate=True))
    assert len(response.embeddings) == 2 and list(response.truncated_inputs) == [1]
    with pytest.raises(grpc.RpcError) as error:
        served.stub().Embed(request("ok", at_limit + "x", truncate=True))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"inputs[1] has {limit + 1} characters, more than max_input_chars={limit}" in error.value.details()


def test_status_counters_equal_what_the_clients_saw(tiny_artifacts) -> None:
    """OK, invalid, overloaded, unauthenticated and an unexpected error: the counters agree with the clients."""
    server = ServerThread(server_config(tiny_artifacts, auth_token="s3cret", max_queue_tokens=20, max_batch_size=1))
    token = [("authorization", "Bearer s3cret")]
    stub = server.stub()
    seen: Counter[tuple[str, str]] = Counter()

    def call(method: str, message, metadata=token) -> None:  # type: ignore[no-untyped-def]
        try:
            getattr(stub, method)(message, metadata=metadata, timeout=10)
            seen[method, "OK"] += 1
        except grpc.RpcError as e:
            seen[method, e.code().name] += 1

    pipeline = server.server.default.pipeline
    real_tokenize = pipeline.tokenize

    async def buggy_tokenize(texts, *args):  # type: ignore[no-untyped-def]
        if list(texts) == ["boom"]:
            raise KeyError("a bug, not a domain error")
        return await real_tokenize(texts, *args)

    pipeline.tokenize = buggy_tokenize  # type: ignore[method-assign]
    try:
        for _ in range(2):
            call("Embed", request("fine"))
        call("Info", embedding_pb2.InfoRequest())
        call("Embed", request())  # empty: invalid
        call("Embed", request("x" * 25_000))  # too long: invalid
        call("Embed", request("fine"), metadata=None)  # no token
        call("Info", embedding_pb2.InfoRequest(), metadata=[("authorization", "Bearer wrong")])
        with pytest.raises(grpc.RpcError) as error:
            stub.Embed(request("boom"), metadata=token, timeout=10)
        assert error.value.code() == grpc.StatusCode.INTERNAL
        assert "KeyError" in error.value.details() and "Traceback" not in error.value.details()
        seen["Embed", "INTERNAL"] += 1
        gate = GatedBackend(server.server)
        running = stub.Embed.future(request("first one runs"), metadata=token)
        eventually(lambda: gate.held == 1, what="the first batch is held")
        queued = stub.Embed.future(request("the second waits in the queue"), metadata=token)
        eventually(lambda: server.server.batcher.queued_items == 1, what="the second request is queued")
        call("Embed", request("a sentence that does not fit"))  # overloaded
        gate.release()
        for future in (running, queued):
            assert len(future.result().embeddings) == 1
            seen["Embed", "OK"] += 1
    finally:
        server.stop()
    assert {code for _, code in seen} == {"OK", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "UNAUTHENTICATED", "INTERNAL"}
    assert requests_by_code(server.server.metrics) == dict(seen)


def test_full_queue_refuses_with_resource_exhausted_and_queues_nothing(tiny_artifacts) -> None:
    waiting = "the second waits in the queue"
    overflow = "a sentence that does not fit"
    tokenizer = TextTokenizer(tiny_artifacts / "tokenizer.json")
    queued_tokens, overflow_tokens = tokenizer.encode([waiting, overflow], False).token_counts
    room = max(queued_tokens, overflow_tokens)  # each fits an empty queue, not both together
    server = ServerThread(server_config(tiny_artifacts, max_queue_tokens=room, max_batch_size=1))
    gate = GatedBackend(server.server)
    stub = server.stub()
    try:
        running = stub.Embed.future(request("first one runs"))
        eventually(lambda: gate.held == 1, what="the first batch is held")
        queued = stub.Embed.future(request(waiting))
        eventually(lambda: server.server.batcher.queued_items == 1, what="the second request is queued")
        assert server.server.batcher.queued_tokens == queued_tokens
        with pytest.raises(grpc.RpcError) as error:
            stub.Embed(request(overflow))
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert server.server.batcher.queued_tokens == queued_tokens  # nothing of it was queued
        gate.release()
        assert len(running.result().embeddings) == 1 and len(queued.result().embeddings) == 1
        assert len(stub.Embed(request(overflow)).embeddings) == 1  # fits once the queue drained
    finally:
        gate.release()
        server.stop()


def test_a_failing_batch_fails_only_its_requests_and_serving_goes_on(
    tiny_artifacts, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="server.api.rpc")
    server = ServerThread(server_config(tiny_artifacts))
    calls = []

    def fails_once(rows):  # type: ignore[no-untyped-def]
        calls.append(len(rows))
        if len(calls) == 1:
            raise RuntimeError("injected fault")
        return real(rows)

    real = server.server.batcher.swap_backend(fails_once)
    stub = server.stub()
    try:
        with pytest.raises(grpc.RpcError) as error:
            stub.Embed(request("unlucky"))
        assert error.value.code() == grpc.StatusCode.INTERNAL
        assert "RuntimeError" in error.value.details()
        assert len(stub.Embed(request("lucky", "again")).embeddings) == 2
        # The log names the id the caller was given, so the caller's report leads to it.
        logged = [r.getMessage() for r in caplog.records if r.name == "server.api.rpc"]
        assert any(request_id(error.value) in m and "INTERNAL" in m for m in logged), logged
    finally:
        server.stop()


def test_cli_prints_json(served: ServerThread, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from client import main

    assert main(["--target", served.target, "embed", "hello", "world"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["embeddings"]) == 2 and len(out["embeddings"][0]) == 32
    assert main(["--target", served.target, "info"]) == 0
    info = json.loads(capsys.readouterr().out)
    trained = served.stub().Info(embedding_pb2.InfoRequest()).models[0].trained_dimensions
    assert info["dim"] == 32 and info["models"][0]["trained_dimensions"] == list(trained)  # a crash: not JSON
    assert main(["--target", served.target, "health"]) == 0
    assert json.loads(capsys.readouterr().out) == {"status": "SERVING"}
    assert main(["--target", served.target, "embed", ""]) == 1
    refused = json.loads(capsys.readouterr().err)
    assert refused["code"] == "INVALID_ARGUMENT" and GENERATED_ID.fullmatch(refused["request_id"])
    assert main(["--target", served.target, "embed", "--dimensions", "8", "hello"]) == 0
    short = np.array(json.loads(capsys.readouterr().out)["embeddings"][0])
    assert short.shape == (8,) and abs(np.linalg.norm(short) - 1) < 1e-5
    # --model before the command or after it, beside the command's own flags.
    name = served.stub().Info(embedding_pb2.InfoRequest()).model
    for where in (["--model", name, "embed"], ["embed", "--model", name]):
        assert main(["--target", served.target, *where, "hello"]) == 0
        assert json.loads(capsys.readouterr().out)["model"] == name
    assert main(["--target", served.target, "embed", "--model", "nope", "hello"]) == 1
    assert "'nope'" in capsys.readouterr().err
    assert main(["--target", served.target, "info", "--model", name]) == 0
    assert json.loads(capsys.readouterr().out)["model"] == name


def test_server_serves_the_int8_model_when_asked(tiny_artifacts, reference) -> None:
    from server.backend.ort import OnnxRuntime, RuntimeOptions
    from server.core.tokenizer import TextTokenizer

    rows = TextTokenizer(tiny_artifacts / "tokenizer.json").encode(SENTENCES, truncate=True).rows
    int8_alone = OnnxRuntime(tiny_artifacts, RuntimeOptions(provider="cpu", precision="int8"), pad_id=0)
    expected = unit(np.stack([int8_alone.run_rows([row])[0] for row in rows]))
    server = ServerThread(server_config(tiny_artifacts, precision="int8"))
    try:
        with EmbeddingClient(server.target) as client:
            assert client.info()["precision"] == "int8"
            # One at a time: int8 quantizes activations per batch, so batch-mates would move the values.
            got = np.array([client.embed([text], truncate=True).embeddings[0] for text in SENTENCES])
    finally:
        server.stop()
    np.testing.assert_allclose(got, expected, atol=1e-5)  # the int8 model's own output, as it gives it alone
    fp32 = unit(np.stack([reference(text) for text in SENTENCES]))
    assert np.abs(got - fp32).max() > 1e-4  # not the fp32 model (the export checks int8's closeness to fp32)


def test_dimensions_keep_the_first_components_renormalised_and_refuse_out_of_range(served: ServerThread) -> None:
    stub = served.stub()
    raw = np.array(stub.Embed(request("the cat sat on the mat", normalize=False)).embeddings[0].values)
    shortened = request("the cat sat on the mat")
    shortened.dimensions = 8
    got = np.array(stub.Embed(shortened).embeddings[0].values)
    assert got.shape == (8,) and abs(np.linalg.norm(got) - 1.0) < 1e-5
    np.testing.assert_allclose(got, raw[:8] / np.linalg.norm(raw[:8]), atol=1e-5)
    with EmbeddingClient(served.target) as client:  # the Python client asks for it the same way
        assert client.embed(["the cat sat on the mat"], dimensions=8).embeddings[0] == pytest.approx(got.tolist())
    for bad in (0, 33):
        shortened.dimensions = bad
        with pytest.raises(grpc.RpcError) as error:
            stub.Embed(shortened)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "dimensions must be between 1 and 32" in error.value.details()
