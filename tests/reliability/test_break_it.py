"""Tests that try to break the service: overload, faults, cancellation, fuzzed input, stuck streams."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from embedding.v1 import embedding_pb2_grpc
from loadtest.run import local_server
from server.api.grpc import STREAM_WINDOW
from server.memory import rss_bytes
from tests.conftest import GatedBackend, ServerThread, counter, eventually, request, requests_by_code, server_config

ROOT = Path(__file__).resolve().parents[2]
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}


def unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x)


def test_overload_is_refused_admitted_work_is_correct_and_memory_bounded(tiny_artifacts, reference) -> None:
    texts = [f"overload text number {i} about the river, the lungs and the quiet cat" for i in range(16)]
    # The server's INFO log (captured, shown on failure) says how far its drain got if it does not exit 0.
    with local_server(str(tiny_artifacts), ["--max-queue-tokens", "1500", "--log-level", "INFO"]) as server:
        target, process = server.target, server.process

        async def offer(clients: int, rounds: int) -> list[tuple[grpc.StatusCode, float, object]]:
            channel = grpc.aio.insecure_channel(target)
            stub = embedding_pb2_grpc.EmbedderStub(channel)
            outcomes = []

            async def client(c: int) -> None:
                for _ in range(rounds):
                    start = time.perf_counter()
                    try:
                        response = await stub.Embed(request(*texts, truncate=True), timeout=30)
                        outcomes.append((grpc.StatusCode.OK, time.perf_counter() - start, response))
                    except grpc.aio.AioRpcError as e:
                        outcomes.append((e.code(), time.perf_counter() - start, None))

            await asyncio.gather(*(client(c) for c in range(clients)))
            await channel.close()
            return outcomes

        asyncio.run(offer(8, 3))  # warm up
        rss_before = rss_bytes(process.pid)
        outcomes = asyncio.run(offer(96, 5))  # 480 requests x 16 texts, far over the queue's 1500 tokens
        rss_after = rss_bytes(process.pid)
        codes = [code for code, _, _ in outcomes]
        assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}, set(codes)
        refused = [seconds for code, seconds, _ in outcomes if code == grpc.StatusCode.RESOURCE_EXHAUSTED]
        answered = [response for code, _, response in outcomes if code == grpc.StatusCode.OK]
        assert len(refused) > 50 and len(answered) > 50, (len(refused), len(answered))
        # (How fast refusals are is a benchmark figure, printed below, not a pass/fail bar: a refused request
        # is never queued, which test_full_queue_refuses_with_resource_exhausted_and_queues_nothing proves.)
        expected = np.array([unit(reference(t)) for t in texts])
        for response in answered:  # every admitted request is complete and correct
            got = np.array([e.values for e in response.embeddings])
            np.testing.assert_allclose(got, expected, atol=1e-5)
        assert rss_after - rss_before < 64 * 1024 * 1024, (rss_before, rss_after)
        print(
            f"\noverload: offered {len(outcomes)} requests x {len(texts)} texts; answered {len(answered)}, refused "
            f"{len(refused)} (median {1000 * np.median(refused):.1f} ms), lost 0; RSS {rss_before >> 20} -> "
            f"{rss_after >> 20} MiB"
        )
        with grpc.insecure_channel(target) as channel:  # serves normally right after
            response = embedding_pb2_grpc.EmbedderStub(channel).Embed(request("calm again"), timeout=10)
            np.testing.assert_allclose(response.embeddings[0].values, unit(reference("calm again")), atol=1e-5)
    assert process.returncode == 0  # drained and exited cleanly after all that


def test_cancelled_requests_are_never_computed(tiny_artifacts) -> None:
    server = ServerThread(server_config(tiny_artifacts))
    gate = GatedBackend(server.server)
    stub = server.stub()
    try:
        blocker = stub.Embed.future(request("x"))
        eventually(lambda: gate.held == 1, what="the blocker's batch is held")
        doomed = [stub.Embed.future(request(f"{'long ' * 10} {i}", truncate=True)) for i in range(5)]
        eventually(lambda: server.server.batcher.queued_items == 5, what="five requests queued")
        for future in doomed:
            future.cancel()
        eventually(lambda: server.server.batcher.queued_items == 0, what="the server sees the cancellations")
        gate.release()
        blocker.result()
        assert stub.Embed(request("after")).embeddings
        assert all(f.cancelled() for f in doomed)
        assert gate.row_lengths == [3, 3]  # only "x" and "after": no cancelled input reached the backend
        assert counter(server.server.metrics.dropped_items, "cancelled") == 5
    finally:
        gate.release()
        server.stop()


texts_strategy = st.lists(
    st.one_of(
        st.text(st.characters(codec="utf-8"), max_size=200),  # any Unicode: controls, combining marks, emoji
        st.text(alphabet="\u0301\u200d\U0001f600 \t\n\x00", max_size=50),
        st.just(""),
        st.just("word " * 5000),  # far over the token limit
        st.just("x" * 25_000),  # over max_input_chars
    ),
    max_size=40,  # the module server allows 32 inputs
)


@pytest.fixture(scope="module")
def fuzzed(tiny_artifacts):  # type: ignore[no-untyped-def]
    server = ServerThread(server_config(tiny_artifacts, max_client_batch_size=32, max_queue_tokens=2000))
    yield server
    server.stop()


FUZZ_SEEN: Counter[tuple[str, str]] = Counter()  # what the fuzzing clients saw, by (method, code)


def expected_code(fuzzed: ServerThread, texts: list[str], truncate: bool) -> grpc.StatusCode:
    """What the module server must answer (its queue is empty between these sequential calls)."""
    if not texts or len(texts) > 32 or any(not t.strip() or len(t) > 20_000 for t in texts):
        return grpc.StatusCode.INVALID_ARGUMENT
    tokenizer = fuzzed.server.default.tokenizer
    if not truncate and any(len(tokenizer.counting.encode(t).ids) > tokenizer.max_length for t in texts):
        return grpc.StatusCode.INVALID_ARGUMENT
    return grpc.StatusCode.OK


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(texts=texts_strategy, truncate=st.booleans(), normalize=st.one_of(st.none(), st.booleans()))
def test_fuzzed_requests_get_exactly_the_expected_code(fuzzed, texts, truncate, normalize) -> None:  # type: ignore[no-untyped-def]
    expected = expected_code(fuzzed, texts, truncate)
    try:
        response = fuzzed.stub().Embed(request(*texts, truncate=truncate, normalize=normalize), timeout=20)
    except grpc.RpcError as e:
        FUZZ_SEEN["Embed", e.code().name] += 1
        assert e.code() == expected, (e.code(), e.details())
        return
    FUZZ_SEEN["Embed", "OK"] += 1
    assert expected == grpc.StatusCode.OK
    vectors = np.array([e.values for e in response.embeddings])
    assert vectors.shape == (len(texts), 32) and np.isfinite(vectors).all()
    if normalize is not False:
        np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(payload=st.binary(max_size=300), method=st.sampled_from(["Embed", "Info", "EmbedStream"]))
def test_malformed_bytes_get_invalid_argument_never_unknown(fuzzed, payload: bytes, method: str) -> None:  # type: ignore[no-untyped-def]
    channel = grpc.insecure_channel(fuzzed.target)
    path = f"/embedding.v1.Embedder/{method}"
    try:
        if method == "EmbedStream":
            call = channel.stream_stream(path, request_serializer=lambda b: b, response_deserializer=lambda b: b)
            list(call(iter([payload]), timeout=20))
        else:
            call = channel.unary_unary(path, request_serializer=lambda b: b, response_deserializer=lambda b: b)
            call(payload, timeout=20)
        FUZZ_SEEN[method, "OK"] += 1
    except grpc.RpcError as e:
        FUZZ_SEEN[method, e.code().name] += 1
        assert e.code() in ALLOWED, (e.code(), e.details())
    finally:
        channel.close()


def test_server_is_up_and_correct_after_the_fuzzing_and_counted_what_clients_saw(fuzzed, reference) -> None:  # type: ignore[no-untyped-def]
    response = fuzzed.stub().Embed(request("the cat sat on the mat"))
    FUZZ_SEEN["Embed", "OK"] += 1
    np.testing.assert_allclose(response.embeddings[0].values, unit(reference("the cat sat on the mat")), atol=1e-5)
    assert counter(fuzzed.server.metrics.batch_failures) == 0
    assert sum(FUZZ_SEEN.values()) >= 121  # the fuzz tests ran against this server first
    # Every answer a client saw (OK and each error code alike) is in embed_requests_total, and nothing else.
    assert requests_by_code(fuzzed.server.metrics) == dict(FUZZ_SEEN)


def test_a_backend_that_keeps_failing_turns_health_not_serving_and_recovers_without_traffic(tiny_artifacts) -> None:
    server = ServerThread(server_config(tiny_artifacts, backend_probe_seconds=0.1))
    broken = threading.Event()
    broken.set()
    calls = []

    def flaky(rows):  # type: ignore[no-untyped-def]
        calls.append(len(rows))
        if broken.is_set():
            raise RuntimeError("device lost")
        return real(rows)

    real = server.server.batcher.swap_backend(flaky)
    stub = server.stub()
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(server.target))

    def status(service: str = "embedding.v1.Embedder") -> int:
        return health.Check(health_pb2.HealthCheckRequest(service=service)).status

    try:
        for i in range(5):
            with pytest.raises(grpc.RpcError) as error:
                stub.Embed(request(f"attempt {i}"))
            assert error.value.code() == grpc.StatusCode.INTERNAL
        eventually(lambda: len(calls) >= 7, what="two probes ran (and failed) after the five requests")
        assert status() == health_pb2.HealthCheckResponse.NOT_SERVING
        assert status("model/wordnet-encoder") == health_pb2.HealthCheckResponse.NOT_SERVING
        batches = counter(server.server.metrics.batches)
        broken.clear()  # the backend recovers; no client sends anything (readiness keeps traffic away)
        eventually(lambda: status() == health_pb2.HealthCheckResponse.SERVING, what="health SERVING again")
        eventually(lambda: status("model/wordnet-encoder") == health_pb2.HealthCheckResponse.SERVING, what="model")
        assert counter(server.server.metrics.batches) == batches  # probes are not counted as served batches
        assert len(stub.Embed(request("recovered")).embeddings) == 1
    finally:
        server.stop()


def test_a_stream_that_stops_reading_or_disconnects_blocks_nobody_and_leaks_nothing(tiny_artifacts) -> None:
    server = ServerThread(server_config(tiny_artifacts, max_streams=2))
    stub = server.stub()
    ended = threading.Event()  # the test is over: the request generators stop holding their streams open
    try:
        sent = threading.Event()

        def requests():  # type: ignore[no-untyped-def]
            for i in range(200):
                yield request(f"stream text {i}", truncate=True)
                if i == 50:
                    sent.set()
            ended.wait(30)  # keep the stream open without reading

        stalled = stub.EmbedStream(requests())  # never read
        assert sent.wait(10)
        # Others are served while it sits there, and a second stream works.
        assert len(stub.Embed(request("still served"), timeout=10).embeddings) == 1
        assert len(list(stub.EmbedStream(iter([request("a"), request("b")]), timeout=10))) == 2

        # The stream limit (2): with the stalled one and a second one open, a third is refused.
        def slow():  # type: ignore[no-untyped-def]
            yield request("c")
            ended.wait(5)

        second = stub.EmbedStream(slow())
        assert next(second).embeddings
        with pytest.raises(grpc.RpcError) as error:
            list(stub.EmbedStream(iter([request("e")]), timeout=10))
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        second.cancel()
        stalled.cancel()  # the client disconnects mid-stream
        eventually(lambda: server.server.service._open_streams == 0, what="both streams closed")
        assert len(stub.Embed(request("after"), timeout=10).embeddings) == 1
    finally:
        ended.set()
        server.stop()


def test_a_cancelled_stream_leaves_nothing_to_compute_and_nothing_counted_ok(tiny_artifacts) -> None:
    server = ServerThread(server_config(tiny_artifacts))
    gate = GatedBackend(server.server)
    stub = server.stub()
    served = server.server
    ended = threading.Event()
    try:
        blocker = stub.Embed.future(request("holds the backend"))
        eventually(lambda: served.state.in_flight == 1 and not served.batcher.queued_items, what="blocker running")

        def requests():  # type: ignore[no-untyped-def]
            for i in range(3 * STREAM_WINDOW):
                yield request(f"stream text {i}")
            ended.wait(30)  # keep the stream open

        stream = stub.EmbedStream(requests())
        # The window fills, then the stream's reader waits for room: the moment the leak happened.
        # Its window's requests are queued (their bodies given back), and the next one is read and held.
        eventually(
            lambda: served.batcher.queued_items == STREAM_WINDOW and served.admission.held_bytes > 0,
            what="the stream's reader waiting for room with its next request",
        )
        stream.cancel()
        eventually(lambda: served.service._open_streams == 0, what="the stream closed")
        # With the backend still held, nothing of the stream waits to be computed or is still in flight.
        eventually(lambda: served.state.in_flight == 1, what="only the blocker in flight")
        assert served.batcher.queued_items == 0
        gate.release()
        assert len(blocker.result().embeddings) == 1
        assert len(stub.Embed(request("after")).embeddings) == 1
        assert gate.batch_sizes == [1, 1]  # the blocker and "after": no streamed input was computed
        assert counter(served.metrics.requests, "EmbedStream", "OK") == 0
        assert counter(served.metrics.requests, "EmbedStream", "CANCELLED") == STREAM_WINDOW
    finally:
        ended.set()
        gate.release()
        server.stop()
