"""The Open Inference Protocol (KServe v2) endpoint, called with the real tritonclient over a socket.

tritonclient brings its own copy of package `inference` into protobuf's default pool; the server's
copy lives in a private pool, so both share this process (importing both is itself the check).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton
from tritonclient.utils import InferenceServerException

from server.api.oip import SERVICE_NAME, pb
from server.backend.ort import OnnxRuntime, RuntimeOptions, pad_rows
from server.core.tokenizer import TextTokenizer
from tests.conftest import SENTENCES, PeerAtStartOnly, ServerThread, counter, request

MODEL = "wordnet-encoder"  # the tiny model's manifest model_id: its served name


@pytest.fixture(scope="module")
def client(served: ServerThread) -> Iterator[triton.InferenceServerClient]:
    with triton.InferenceServerClient(served.target) as c:
        yield c


def text_input(texts: list[str]) -> triton.InferInput:
    tensor = triton.InferInput("text", [len(texts)], "BYTES")
    tensor.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=np.object_))
    return tensor


def token_inputs(ids: np.ndarray, mask: np.ndarray) -> list[triton.InferInput]:
    tensors = []
    for name, value in (("input_ids", ids), ("attention_mask", mask)):
        tensor = triton.InferInput(name, list(value.shape), "INT64")
        tensor.set_data_from_numpy(value.astype(np.int64))
        tensors.append(tensor)
    return tensors


def padded_tokens(model_dir: Path, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    rows = TextTokenizer(model_dir / "tokenizer.json").encode(texts, truncate=True).rows
    return pad_rows(rows, pad_id=0)


def raw_infer(served: ServerThread, message, metadata=None):  # type: ignore[no-untyped-def]
    """ModelInfer with a hand-built request (forms tritonclient never sends)."""
    with grpc.insecure_channel(served.target) as channel:
        call = channel.unary_unary(
            f"/{SERVICE_NAME}/ModelInfer",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=pb.ModelInferResponse.FromString,
        )
        return call(message, timeout=10, metadata=metadata)


def test_server_and_model_liveness_readiness_and_metadata(client: triton.InferenceServerClient) -> None:
    assert client.is_server_live() and client.is_server_ready()
    assert client.get_server_metadata().name == "embedding-service"
    assert client.is_model_ready(MODEL)
    assert client.is_model_ready(MODEL, "1")  # the Triton repository's version folder
    assert not client.is_model_ready("no-such-model")
    assert not client.is_model_ready(MODEL, "no-such-version")
    metadata = client.get_model_metadata(MODEL)
    assert metadata.name == MODEL and metadata.platform == "onnxruntime_onnx"
    assert {(t.name, t.datatype, tuple(t.shape)) for t in metadata.inputs} == {
        ("text", "BYTES", (-1,)),
        ("input_ids", "INT64", (-1, -1)),
        ("attention_mask", "INT64", (-1, -1)),
    }
    assert [(t.name, t.datatype, tuple(t.shape)) for t in metadata.outputs] == [("embeddings", "FP32", (-1, 32))]


def test_unknown_model_is_invalid_argument_naming_the_served_ones(client: triton.InferenceServerClient) -> None:
    for call in (
        lambda: client.get_model_metadata("no-such-model"),
        lambda: client.infer("no-such-model", [text_input(["a dog"])]),
    ):
        with pytest.raises(InferenceServerException) as e:
            call()
        assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert "no-such-model" in e.value.message() and MODEL in e.value.message()


def test_text_mode_equals_embed(served: ServerThread, client: triton.InferenceServerClient) -> None:
    with pytest.raises(InferenceServerException, match="more than the limit of 32; shorten it or set truncate"):
        client.infer(MODEL, [text_input(SENTENCES)])  # truncate defaults to false, as in Embed
    result = client.infer(MODEL, [text_input(SENTENCES)], request_id="req-7", parameters={"truncate": True})
    got = result.as_numpy("embeddings")
    assert got.dtype == np.float32 and got.shape == (len(SENTENCES), 32)
    assert result.get_response().id == "req-7" and result.get_response().model_name == MODEL
    want = np.array([e.values for e in served.stub().Embed(request(*SENTENCES, truncate=True)).embeddings])
    cosine = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert cosine.min() >= 0.9999
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)  # normalised by default


def test_text_mode_normalize_parameter_gives_raw_vectors(served: ServerThread, client) -> None:  # type: ignore[no-untyped-def]
    texts = SENTENCES[:2]
    got = client.infer(MODEL, [text_input(texts)], parameters={"normalize": False}).as_numpy("embeddings")
    want = np.array([e.values for e in served.stub().Embed(request(*texts, normalize=False)).embeddings])
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert not np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-3)


def test_token_mode_equals_onnx_runtime_on_the_same_tensors(tiny_artifacts: Path, client) -> None:  # type: ignore[no-untyped-def]
    ids, mask = padded_tokens(tiny_artifacts, SENTENCES)
    got = client.infer(MODEL, token_inputs(ids, mask)).as_numpy("embeddings")
    want = OnnxRuntime(tiny_artifacts, RuntimeOptions(provider="cpu"), pad_id=0).run(ids, mask)
    assert np.abs(got - want).max() <= 1e-5  # not normalised: exactly what Triton serving model.onnx returns
    normalized = client.infer(MODEL, token_inputs(ids, mask), parameters={"normalize": True}).as_numpy("embeddings")
    np.testing.assert_allclose(normalized, want / np.linalg.norm(want, axis=1, keepdims=True), atol=1e-5)


def test_bytes_contents_equal_raw_contents(served: ServerThread, client) -> None:  # type: ignore[no-untyped-def]
    message = pb.ModelInferRequest(model_name=MODEL)
    tensor = message.inputs.add(name="text", datatype="BYTES", shape=[2])
    tensor.contents.bytes_contents.extend([b"a dog", "caf\u00e9 au lait".encode()])
    response = raw_infer(served, message)
    got = np.frombuffer(response.raw_output_contents[0], dtype="<f4").reshape(list(response.outputs[0].shape))
    want = client.infer(MODEL, [text_input(["a dog", "caf\u00e9 au lait"])]).as_numpy("embeddings")
    np.testing.assert_allclose(got, want, atol=1e-6)


def test_infer_reads_the_client_address_once_when_the_call_starts(served: ServerThread) -> None:
    message = pb.ModelInferRequest(model_name=MODEL)
    message.inputs.add(name="text", datatype="BYTES", shape=[1]).contents.bytes_contents.append(b"a dog")
    context = PeerAtStartOnly(message)
    response = served.call(served.server.inference.ModelInfer(context.stream(), context))
    assert list(response.outputs[0].shape) == [1, 32]


def _text(shape: list[int], datatype: str = "BYTES", raw: bytes = b"\x05\x00\x00\x00a dog"):  # type: ignore[no-untyped-def]
    message = pb.ModelInferRequest(model_name=MODEL)
    message.inputs.add(name="text", datatype=datatype, shape=shape)
    message.raw_input_contents.append(raw)
    return message


def _tokens(ids: list[list[int]], mask: list[list[int]], datatype: str = "INT64"):  # type: ignore[no-untyped-def]
    message = pb.ModelInferRequest(model_name=MODEL)
    for name, value in (("input_ids", ids), ("attention_mask", mask)):
        tensor = message.inputs.add(name=name, datatype=datatype, shape=list(np.shape(value)))
        tensor.contents.int64_contents.extend(np.ravel(value).tolist())
    return message


def _with_shape(message, shape: list[int]):  # type: ignore[no-untyped-def]
    del message.inputs[0].shape[:]
    message.inputs[0].shape.extend(shape)
    return message


def _with_output(message, name: str):  # type: ignore[no-untyped-def]
    message.outputs.add(name=name)
    return message


def _with_contents(message):  # type: ignore[no-untyped-def]
    message.inputs[0].contents.bytes_contents.append(b"a cat")
    return message


BAD_REQUESTS = {
    "text as INT64": (_text([1], "INT64"), "'text' must be BYTES"),
    "text of shape [1, 2]": (_text([1, 2]), "shape [N] or [N, 1]"),
    "count and contents differ": (_text([2]), "needs 2 elements, the contents hold 1"),
    "length prefix past the end": (_text([1], raw=b"\x09\x00\x00\x00a dog"), "element 0 says 9 bytes"),
    "not UTF-8": (_text([1], raw=b"\x02\x00\x00\x00\xff\xfe"), "element 0 is not valid UTF-8"),
    "blank text": (_text([1], raw=b"\x02\x00\x00\x00  "), "text[0] is empty or only whitespace"),
    "unknown input": (pb.ModelInferRequest(model_name=MODEL, inputs=[{"name": "texts"}]), "send either 'text'"),
    "ids as INT32": (_tokens([[2, 5, 3]], [[1, 1, 1]], "INT32"), "'input_ids' must be INT64"),
    "ids of rank 1": (_tokens([2, 5, 3], [1, 1, 1]), "'input_ids' must have shape [N, T]"),
    "mask shape differs": (_tokens([[2, 5, 3]], [[1, 1]]), "differ in shape"),
    "left padding": (_tokens([[0, 2, 3]], [[0, 1, 1]]), "attention_mask row 0 must be ones then zeros"),
    "empty mask row": (_tokens([[2, 3], [0, 0]], [[1, 1], [0, 0]]), "attention_mask row 1"),
    "id outside the vocabulary": (_tokens([[2, 100_000, 3]], [[1, 1, 1]]), "outside the vocabulary [0, "),
    "longer than the model": (_tokens([[2] * 33], [[1] * 33]), "33 positions, more than the model's limit of 32"),
    "huge shape": (_with_shape(_tokens([[2, 3]], [[1, 1]]), [2**40, 2**40]), "the contents hold 2"),
    "negative shape": (_with_shape(_text([1]), [-1]), "negative dimension"),
    "unknown output": (_with_output(_text([1]), "pooled"), "unknown output 'pooled'"),
    "contents and raw contents": (_with_contents(_text([1])), "'text' has contents while raw_input_contents is used"),
    "wrong version": (pb.ModelInferRequest(model_name=MODEL, model_version="7"), "not '7'"),
}


@pytest.mark.parametrize("case", BAD_REQUESTS)
def test_bad_requests_are_invalid_argument_naming_the_tensor(served: ServerThread, case: str) -> None:
    message, words = BAD_REQUESTS[case]
    with pytest.raises(grpc.RpcError) as e:
        raw_infer(served, message)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    assert words in e.value.details()


def test_malformed_bytes_are_invalid_argument(served: ServerThread) -> None:
    with grpc.insecure_channel(served.target) as channel:
        call = channel.unary_unary(f"/{SERVICE_NAME}/ModelInfer")
        with pytest.raises(grpc.RpcError) as e:
            call(b"\xff\xff\xff", timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "malformed request" in e.value.details()


def test_model_infer_is_counted_with_its_model(served: ServerThread, client: triton.InferenceServerClient) -> None:
    metrics = served.server.metrics
    served.settled()
    before = counter(metrics.requests, "ModelInfer", "OK", MODEL), counter(metrics.inputs, MODEL)
    client.infer(MODEL, [text_input(["a dog", "a cat"])])
    served.settled()
    after = counter(metrics.requests, "ModelInfer", "OK", MODEL), counter(metrics.inputs, MODEL)
    assert (after[0] - before[0], after[1] - before[1]) == (1, 2)
