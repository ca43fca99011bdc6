"""The Open Inference Protocol (KServe v2) service, on the same port and batchers as Embedder.

Two ways in, both answered with ``embeddings``, FP32 [N, dim]: text (``text``, BYTES [N]; normalised unless
the parameter ``normalize`` is false) or tokens (``input_ids`` and ``attention_mask``, INT64 [N, T], right
padded; not normalised unless ``normalize`` is true, as Triton serving the exported repository answers).
Errors use the gRPC table of server/api/rpc.py. The messages live in a private descriptor pool built from
the published proto, so this module can share a process with tritonclient's own copy of ``inference``.
"""

from __future__ import annotations

import math
import struct
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from server.api.rpc import Call, Received, RpcAccounting, deadline_of, receiving
from server.core.admission import Admission
from server.core.errors import BadInput, InvalidInput
from server.core.pipeline import Tokenized, check_count
from server.core.registry import ServedModel, ServingState
from server.metrics import Metrics

DESCRIPTOR_SET = Path(__file__).resolve().parents[1] / "_proto" / "open_inference_grpc.binpb"  # make protos
SERVICE_NAME = "inference.GRPCInferenceService"
SERVER_NAME = "embedding-service"
TRITON_VERSION = "1"  # the version folder of the Triton repository `make export` writes: accepted as an alias
METHODS = ("ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata", "ModelInfer")
MESSAGES = [f"{method}{kind}" for method in METHODS for kind in ("Request", "Response")]
TEXT_INPUT = "text"
TOKEN_INPUTS = ("input_ids", "attention_mask")
OUTPUT = "embeddings"


def load_messages(path: Path = DESCRIPTOR_SET) -> Any:
    """The protocol's message classes, built in a pool of their own (see the module docstring)."""
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: run `make protos` (it compiles protos/inference/v2)")
    pool = descriptor_pool.DescriptorPool()
    for file in descriptor_pb2.FileDescriptorSet.FromString(path.read_bytes()).file:
        pool.Add(file)
    classes = {
        name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"inference.{name}")) for name in MESSAGES
    }
    return SimpleNamespace(**classes)


pb = load_messages()


# ---- tensors in and out ---------------------------------------------------------------------------
def _shape(tensor: Any) -> list[int]:
    return [int(d) for d in tensor.shape]


def _count(shape: list[int], name: str) -> int:
    if any(d < 0 for d in shape):
        raise InvalidInput(f"input {name!r}: shape {shape} has a negative dimension")
    return math.prod(shape)  # exact for any size: a huge shape is refused, never wrapped around


def decode_text(tensor: Any, raw: bytes | None) -> list[str]:
    """BYTES [N] or [N, 1] -> N strings (UTF-8)."""
    shape = _shape(tensor)
    if tensor.datatype != "BYTES":
        raise InvalidInput(f"input {TEXT_INPUT!r} must be BYTES, not {tensor.datatype or 'unset'}")
    if len(shape) not in (1, 2) or (len(shape) == 2 and shape[1] != 1):
        raise InvalidInput(f"input {TEXT_INPUT!r} must have shape [N] or [N, 1], not {shape}")
    n = _count(shape, TEXT_INPUT)
    if raw is None:
        items = list(tensor.contents.bytes_contents)
    else:
        items, offset = [], 0
        while offset < len(raw):
            if offset + 4 > len(raw):
                raise InvalidInput(f"input {TEXT_INPUT!r}: raw contents end inside a 4-byte length prefix")
            (size,) = struct.unpack_from("<I", raw, offset)
            if offset + 4 + size > len(raw):
                raise InvalidInput(f"input {TEXT_INPUT!r}: element {len(items)} says {size} bytes, fewer remain")
            items.append(raw[offset + 4 : offset + 4 + size])
            offset += 4 + size
    if len(items) != n:
        raise InvalidInput(f"input {TEXT_INPUT!r}: shape {shape} needs {n} elements, the contents hold {len(items)}")
    texts = []
    for i, item in enumerate(items):
        try:
            texts.append(item.decode("utf-8"))
        except UnicodeDecodeError:
            raise InvalidInput(f"input {TEXT_INPUT!r}: element {i} is not valid UTF-8") from None
    return texts


def decode_int64(tensor: Any, raw: bytes | None) -> np.ndarray:
    """INT64 [N, T] -> an (N, T) int64 array."""
    shape = _shape(tensor)
    if tensor.datatype != "INT64":
        raise InvalidInput(f"input {tensor.name!r} must be INT64, not {tensor.datatype or 'unset'}")
    if len(shape) != 2 or shape[0] < 1 or shape[1] < 1:
        raise InvalidInput(f"input {tensor.name!r} must have shape [N, T] with N, T >= 1, not {shape}")
    n = _count(shape, tensor.name)
    if raw is None:
        values = np.asarray(tensor.contents.int64_contents, dtype=np.int64)
    else:
        if len(raw) != n * 8:
            raise InvalidInput(f"input {tensor.name!r}: shape {shape} needs {n * 8} raw bytes, got {len(raw)}")
        values = np.frombuffer(raw, dtype="<i8").astype(np.int64)
    if values.size != n:
        raise InvalidInput(f"input {tensor.name!r}: shape {shape} needs {n} elements, the contents hold {values.size}")
    return values.reshape(shape)


def token_rows(ids: np.ndarray, mask: np.ndarray, model: ServedModel) -> list[np.ndarray]:
    """Right-padded ids and mask -> one unpadded row per input, checked against the model."""
    if ids.shape != mask.shape:
        raise InvalidInput(f"input_ids {list(ids.shape)} and attention_mask {list(mask.shape)} differ in shape")
    limit = model.info.max_input_length
    if ids.shape[1] > limit:
        raise InvalidInput(f"input_ids has {ids.shape[1]} positions, more than the model's limit of {limit}")
    lengths = mask.sum(axis=1)
    right_padded = mask == (np.arange(mask.shape[1]) < lengths[:, None])
    if not right_padded.all() or (lengths < 1).any():
        row = int(np.nonzero(~right_padded.all(axis=1) | (lengths < 1))[0][0])
        raise InvalidInput(f"attention_mask row {row} must be ones then zeros (right padding, at least one token)")
    vocab = model.info.vocab_size
    real = ids[mask == 1]
    if real.size and (real.min() < 0 or real.max() >= vocab):
        raise InvalidInput(f"input_ids holds a token id outside the vocabulary [0, {vocab})")
    return [np.ascontiguousarray(ids[i, : lengths[i]]) for i in range(ids.shape[0])]


def _answers_to(model: ServedModel, version: str) -> bool:
    """ "" (any), the manifest's version, or the Triton repository's version folder."""
    return version in ("", model.info.model_version, TRITON_VERSION)


def _bool_parameter(request: Any, name: str, default: bool) -> bool:
    if name not in request.parameters:
        return default
    value = request.parameters[name]
    if value.WhichOneof("parameter_choice") != "bool_param":
        raise InvalidInput(f"parameter {name!r} must be a bool")
    return bool(value.bool_param)


# ---- the servicer ---------------------------------------------------------------------------------
class OpenInferenceService(RpcAccounting):
    def __init__(self, state: ServingState, metrics: Metrics, admission: Admission, version: str) -> None:
        super().__init__(state, metrics, admission)
        self.version = version

    async def ServerLive(self, received: Received, context: grpc.aio.ServicerContext) -> Any:
        return await self._unary("ServerLive", received, context, lambda call: self._live(received.take(), call))

    async def ServerReady(self, received: Received, context: grpc.aio.ServicerContext) -> Any:
        return await self._unary("ServerReady", received, context, lambda call: self._ready(received.take(), call))

    async def ModelReady(self, received: Received, context: grpc.aio.ServicerContext) -> Any:
        return await self._unary("ModelReady", received, context, lambda call: self._model_ready(received.take(), call))

    async def ServerMetadata(self, received: Received, context: grpc.aio.ServicerContext) -> Any:
        return await self._unary(
            "ServerMetadata", received, context, lambda call: self._server_metadata(received.take(), call)
        )

    async def ModelMetadata(self, received: Received, context: grpc.aio.ServicerContext) -> Any:
        return await self._unary("ModelMetadata", received, context, lambda call: self._metadata(received.take(), call))

    async def ModelInfer(self, requests: Any, context: grpc.aio.ServicerContext) -> Any:
        return await self._admitted("ModelInfer", context, lambda call, received: self._infer(received, context, call))

    async def _live(self, request: Any, call: Call) -> Any:
        return pb.ServerLiveResponse(live=True)

    async def _ready(self, request: Any, call: Call) -> Any:
        return pb.ServerReadyResponse(ready=self.state.ready)

    async def _model_ready(self, request: Any, call: Call) -> Any:
        """A model that is not served is simply not ready: probes get an answer, not an error."""
        model = self.state.find(request.name) if request.name and self.state.ready else None
        if model is not None:
            call.model = model.name
        ready = model is not None and _answers_to(model, request.version)
        return pb.ModelReadyResponse(ready=ready)

    async def _server_metadata(self, request: Any, call: Call) -> Any:
        return pb.ServerMetadataResponse(name=SERVER_NAME, version=self.version, extensions=[])

    def _model(self, request: Any, call: Call, name_field: str, version_field: str) -> ServedModel:
        model = self._admit(request, call, name_field)
        version = getattr(request, version_field)
        if not _answers_to(model, version):
            raise InvalidInput(
                f"model {model.name!r} has version {model.info.model_version!r} (or {TRITON_VERSION!r}, "
                f"the Triton repository's), not {version!r}"
            )
        return model

    async def _metadata(self, request: Any, call: Call) -> Any:
        info = self._model(request, call, "name", "version").info
        tensor = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(
            name=info.name,
            versions=[info.model_version],
            platform="onnxruntime_onnx",
            inputs=[
                tensor(name=TEXT_INPUT, datatype="BYTES", shape=[-1]),
                tensor(name=TOKEN_INPUTS[0], datatype="INT64", shape=[-1, -1]),
                tensor(name=TOKEN_INPUTS[1], datatype="INT64", shape=[-1, -1]),
            ],
            outputs=[tensor(name=OUTPUT, datatype="FP32", shape=[-1, info.dim])],
            properties={
                "model_id": info.model_id,
                "max_input_length": str(info.max_input_length),
                "vocab_size": str(info.vocab_size),
                "inputs": "either text (BYTES [N]) or input_ids and attention_mask (INT64 [N, T], right-padded)",
                "normalize": "text: true by default; tokens: false by default; request parameter 'normalize'",
            },
        )

    async def _infer(self, received: Received, context: grpc.aio.ServicerContext, call: Call) -> Any:
        request = received.take()
        model = self._model(request, call, "model_name", "model_version")
        for wanted in request.outputs:
            if wanted.name != OUTPUT:
                raise InvalidInput(f"unknown output {wanted.name!r}: this model has only {OUTPUT!r}")
        inputs = list(request.inputs)
        raw = list(request.raw_input_contents)
        if raw and len(raw) != len(inputs):
            raise InvalidInput(f"raw_input_contents has {len(raw)} entries for {len(inputs)} inputs")
        both = [t.name for t in inputs if raw and t.HasField("contents")]
        if both:  # which of the two to read would be a guess (Triton refuses it too)
            raise InvalidInput(f"input {both[0]!r} has contents while raw_input_contents is used: send one of them")
        tensors = {t.name: (t, raw[i] if raw else None) for i, t in enumerate(inputs)}
        if len(tensors) != len(inputs):
            raise InvalidInput("an input name appears twice")
        deadline = deadline_of(context)
        client = call.client
        request_id = request.id
        if set(tensors) == {TEXT_INPUT}:
            texts = decode_text(*tensors[TEXT_INPUT])
            normalize = _bool_parameter(request, "normalize", True)
            try:
                tokenized = await model.pipeline.tokenize(texts, _bool_parameter(request, "truncate", False), client)
            except BadInput as e:  # the tensor is `text`, not Embed's `inputs`
                raise InvalidInput(f"{TEXT_INPUT}[{e.index}] {e.problem}") from None
            del texts
        elif set(tensors) == set(TOKEN_INPUTS):
            ids, mask = (decode_int64(*tensors[name]) for name in TOKEN_INPUTS)
            tokenized = Tokenized(token_rows(ids, mask, model), [], 0.0)
            check_count(len(tokenized.rows), model.pipeline.limits)
            normalize = _bool_parameter(request, "normalize", False)
        else:
            raise InvalidInput(
                f"inputs {sorted(tensors)}: send either {TEXT_INPUT!r} (BYTES [N]) or "
                f"{TOKEN_INPUTS[0]!r} and {TOKEN_INPUTS[1]!r} (INT64 [N, T])"
            )
        del request, inputs, raw, tensors  # only the token rows wait for the batch (see service._embed)
        received.release()
        result = await model.pipeline.compute(tokenized, normalize, deadline, client)
        embeddings = np.ascontiguousarray(result.embeddings, dtype="<f4")
        response = pb.ModelInferResponse(model_name=model.name, model_version=model.info.model_version, id=request_id)
        response.outputs.add(name=OUTPUT, datatype="FP32", shape=list(embeddings.shape))
        response.raw_output_contents.append(embeddings.tobytes())
        return response


def add_to_server(service: OpenInferenceService, server: grpc.aio.Server, admission: Admission) -> None:
    """Generic handlers (no generated stubs): bodies admitted before parsing, as for Embedder."""
    handlers = {}
    for method in METHODS:
        request_class = getattr(pb, f"{method}Request")
        # ModelInfer carries bodies: request-streaming, so it is admitted before its body is read (server/api/rpc.py).
        make = grpc.stream_unary_rpc_method_handler if method == "ModelInfer" else grpc.unary_unary_rpc_method_handler
        handlers[method] = make(
            getattr(service, method), receiving(request_class.FromString, admission), lambda m: m.SerializeToString()
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)
