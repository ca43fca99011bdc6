"""Several models in one server: names, defaults, Info, health, metrics, and admission per model."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton
from grpc_health.v1 import health_pb2, health_pb2_grpc

from embedding.v1 import embedding_pb2, embedding_pb2_grpc
from server.backend.ort import OnnxRuntime, RuntimeOptions
from server.core.tokenizer import TextTokenizer
from tests.conftest import GatedBackend, ServerThread, counter, eventually, server_config

TEXTS = ["a dog", "the cat sat on the mat", "move fast"]


@pytest.fixture(scope="module")
def two_models(tiny_artifacts: Path, tiny_bert_artifacts: Path) -> Iterator[ServerThread]:
    config = server_config(tiny_artifacts, model=(f"small={tiny_artifacts}", f"bert={tiny_bert_artifacts}"))
    server = ServerThread(config)
    yield server
    server.stop()


def alone(model_dir: Path, texts: list[str]) -> np.ndarray:
    """ONNX Runtime on each text alone, normalised: what the model's served embeddings must equal."""
    tokenizer = TextTokenizer(model_dir / "tokenizer.json")
    runtime = OnnxRuntime(model_dir, RuntimeOptions(provider="cpu"), pad_id=0)
    rows = [runtime.run_rows(tokenizer.encode([t], truncate=True).rows)[0] for t in texts]
    return np.array([r / np.linalg.norm(r) for r in rows])


def embed(server: ServerThread, model: str | None, texts: list[str] = TEXTS) -> embedding_pb2.EmbedResponse:
    message = embedding_pb2.EmbedRequest(inputs=texts)
    if model is not None:
        message.model = model
    return server.stub().Embed(message, timeout=10)


def vectors(response: embedding_pb2.EmbedResponse) -> np.ndarray:
    return np.array([e.values for e in response.embeddings])


def test_each_model_answers_with_its_own_embeddings(
    two_models: ServerThread, tiny_artifacts: Path, tiny_bert_artifacts: Path
) -> None:
    small, bert = embed(two_models, "small"), embed(two_models, "bert")
    assert (small.model, bert.model) == ("small", "bert")
    np.testing.assert_allclose(vectors(small), alone(tiny_artifacts, TEXTS), atol=1e-5)
    np.testing.assert_allclose(vectors(bert), alone(tiny_bert_artifacts, TEXTS), atol=1e-5)
    assert not np.allclose(vectors(small), vectors(bert), atol=1e-2)
    default = embed(two_models, None)  # unset and empty both mean the first model
    assert default.model == "small" and embed(two_models, "").model == "small"
    np.testing.assert_allclose(vectors(default), vectors(small), atol=1e-6)
    # The Triton repository's folder name (the model_id without its owner) is the same model.
    assert embed(two_models, "tiny-bert").model == "bert"


def test_unknown_model_is_invalid_argument_naming_the_served_ones(two_models: ServerThread) -> None:
    with pytest.raises(grpc.RpcError) as e:
        embed(two_models, "large")
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'large'" in e.value.details() and "'small', 'bert'" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        two_models.stub().Info(embedding_pb2.InfoRequest(model="large"))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_info_lists_every_model_default_first(two_models: ServerThread) -> None:
    info = two_models.stub().Info(embedding_pb2.InfoRequest())
    assert info.model == "small" and info.model_id == "wordnet-encoder"
    assert [(m.name, m.model_id, m.is_default) for m in info.models] == [
        ("small", "wordnet-encoder", True),
        ("bert", "test/tiny-bert", False),
    ]
    # Trained lengths from each manifest: the tiny student's prefix and full width; the BERT export, full only.
    assert [list(m.trained_dimensions) for m in info.models] == [[16, 32], [info.models[1].dim]]
    bert = two_models.stub().Info(embedding_pb2.InfoRequest(model="bert"))
    assert (bert.model, bert.model_id, bert.max_input_length) == (
        "bert",
        "test/tiny-bert",
        info.models[1].max_input_length,
    )


def test_answers_say_whether_the_asked_length_was_trained(two_models: ServerThread) -> None:
    """dimensions is served on every model; the answer says whether the model was trained at that length
    (its manifest's trained lengths): a field over gRPC, a header over HTTP, unset when not asked."""
    import httpx

    from client import EmbeddingClient

    def grpc_says(model: str, dimensions: int | None) -> bool | None:
        message = embedding_pb2.EmbedRequest(inputs=TEXTS, model=model)
        if dimensions is not None:
            message.dimensions = dimensions
        response = two_models.stub().Embed(message, timeout=10)
        return response.dimensions_trained if response.HasField("dimensions_trained") else None

    def http_says(model: str, dimensions: int | None) -> str | None:
        body: dict[str, object] = {"input": TEXTS, "model": model}
        if dimensions is not None:
            body["dimensions"] = dimensions
        url = f"http://127.0.0.1:{two_models.server.http_port}/v1/embeddings"
        answer = httpx.post(url, json=body, timeout=10)
        assert answer.status_code == 200
        return answer.headers.get("x-dimensions-trained")

    cases = [("small", 16, True), ("small", 32, True), ("small", 8, False), ("bert", 16, False), ("small", None, None)]
    for model, dimensions, trained in cases:
        assert grpc_says(model, dimensions) is trained, (model, dimensions)
        assert http_says(model, dimensions) == (None if trained is None else str(trained).lower()), (model, dimensions)
    with EmbeddingClient(two_models.target) as client:
        assert client.embed(TEXTS, model="small", dimensions=16).dimensions_trained is True
        assert client.embed(TEXTS, model="small").dimensions_trained is None


def test_health_has_an_entry_per_model(two_models: ServerThread) -> None:
    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(two_models.target))
    for service in ("", "embedding.v1.Embedder", "inference.GRPCInferenceService", "model/small", "model/bert"):
        status = stub.Check(health_pb2.HealthCheckRequest(service=service)).status
        assert status == health_pb2.HealthCheckResponse.SERVING, service
    with pytest.raises(grpc.RpcError) as e:
        stub.Check(health_pb2.HealthCheckRequest(service="model/large"))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_metrics_carry_the_model_label(two_models: ServerThread) -> None:
    metrics = two_models.server.metrics
    before = {m: counter(metrics.inputs, m) for m in ("small", "bert")}
    embed(two_models, "bert")
    assert counter(metrics.inputs, "bert") - before["bert"] == len(TEXTS)
    assert counter(metrics.inputs, "small") == before["small"]
    models = {s.labels["model"] for f in metrics.model_info.collect() for s in f.samples}
    assert models == {"small", "bert"}


def test_the_model_info_metric_says_up_to_which_size_batches_run_on_one_cpu_thread(tiny_artifacts: Path) -> None:
    server = ServerThread(server_config(tiny_artifacts, one_thread_batch_tokens=8, intra_op_threads=2))
    try:
        samples = [s for f in server.server.metrics.model_info.collect() for s in f.samples]
        assert [s.labels["one_thread_batch_tokens"] for s in samples] == ["8"]
        assert [s.labels["provider"] for s in samples] == ["CPUExecutionProvider"]
    finally:
        server.stop()


def test_open_inference_protocol_reaches_each_model(two_models: ServerThread) -> None:
    with triton.InferenceServerClient(two_models.target) as client:
        for name in ("small", "bert"):
            tensor = triton.InferInput("text", [len(TEXTS)], "BYTES")
            tensor.set_data_from_numpy(np.array([t.encode() for t in TEXTS], dtype=np.object_))
            got = client.infer(name, [tensor]).as_numpy("embeddings")
            np.testing.assert_allclose(got, vectors(embed(two_models, name)), atol=1e-5)
        assert client.is_model_ready("small") and client.is_model_ready("bert")


def test_an_overloaded_model_does_not_refuse_requests_to_the_other(
    tiny_artifacts: Path, tiny_bert_artifacts: Path
) -> None:
    """Each model has its own queue of max_queue_tokens: filling one refuses only its own requests."""
    config = server_config(
        tiny_artifacts, model=(f"small={tiny_artifacts}", f"bert={tiny_bert_artifacts}"), max_queue_tokens=64
    )
    server = ServerThread(config)
    gate = GatedBackend(server.server, "small")
    try:

        async def flood() -> tuple[list[grpc.StatusCode], list[grpc.StatusCode]]:
            async with grpc.aio.insecure_channel(server.target) as channel:
                stub = embedding_pb2_grpc.EmbedderStub(channel)

                async def one(model: str) -> grpc.StatusCode:
                    try:
                        await stub.Embed(embedding_pb2.EmbedRequest(inputs=["the cat sat on the mat"], model=model))
                        return grpc.StatusCode.OK
                    except grpc.aio.AioRpcError as e:
                        return e.code()

                small = [asyncio.ensure_future(one("small")) for _ in range(30)]
                # Wait until the held model refuses (its queue is full), then ask the other model.
                await asyncio.sleep(0)
                while not any(t.done() for t in small):
                    await asyncio.sleep(0.01)
                # One at a time: ten at once could fill bert's own 64-token queue while its first batch runs.
                bert = [await one("bert") for _ in range(10)]
                gate.release()
                return list(await asyncio.gather(*small)), list(bert)

        small_codes, bert_codes = asyncio.run(flood())
        assert grpc.StatusCode.RESOURCE_EXHAUSTED in small_codes  # the held model's queue filled up
        assert bert_codes == [grpc.StatusCode.OK] * 10  # the other model served every request meanwhile
        eventually(lambda: counter(server.server.metrics.rejections, "overloaded", "small") > 0)
        assert counter(server.server.metrics.rejections, "overloaded", "bert") == 0
    finally:
        gate.remove()
        server.stop()
