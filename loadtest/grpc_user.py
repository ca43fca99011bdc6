"""A Locust User for gRPC: every call goes to Locust's statistics with its time, size and status code."""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Callable, Iterator
from typing import Any

# Locust runs users as gevent greenlets: grpc must be told before any channel exists.
import grpc
import grpc.experimental.gevent as grpc_gevent

grpc_gevent.init_gevent()

from locust import User  # noqa: E402

from client import Security  # noqa: E402
from embedding.v1 import embedding_pb2, embedding_pb2_grpc  # noqa: E402
from server.api.oip import SERVICE_NAME as INFERENCE_SERVICE  # noqa: E402
from server.api.oip import pb as inference_pb  # noqa: E402


class GrpcCallFailed(Exception):
    """Shown in Locust's failure table as 'CODE: details', so failures group by status code."""

    def __init__(self, code: grpc.StatusCode, details: str | None) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code


class GrpcUser(User):
    abstract = True
    timeout = 30.0

    def __init__(self, environment: Any) -> None:
        super().__init__(environment)
        target = (self.host or "localhost:50051").removeprefix("grpc://").removeprefix("http://")
        self.channel = grpc.insecure_channel(target)
        # The bearer token a protected server asks for, from the variable the HTTP user and client read.
        self.metadata = Security(token=os.environ.get("EMBED_AUTH_TOKEN", "")).metadata()
        self.stub = embedding_pb2_grpc.EmbedderStub(self.channel)
        self.model_infer_call = self.channel.unary_unary(
            f"/{INFERENCE_SERVICE}/ModelInfer",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=inference_pb.ModelInferResponse.FromString,
        )

    def on_stop(self) -> None:
        self.channel.close()

    def _report(self, name: str, call: Callable[[], int]) -> None:
        start = time.perf_counter()
        size, error, code = 0, None, grpc.StatusCode.OK
        try:
            size = call()
        except grpc.RpcError as e:
            code = e.code()
            error = GrpcCallFailed(code, e.details())
        except GrpcCallFailed as e:
            code, error = e.code, e
        self.environment.events.request.fire(
            request_type="grpc",
            name=name,
            response_time=(time.perf_counter() - start) * 1000,
            response_length=size,
            exception=error,
            context={"grpc_code": code.name},
        )

    def embed(self, name: str, texts: list[str], truncate: bool = True) -> None:
        request = embedding_pb2.EmbedRequest(inputs=texts, truncate=truncate)
        self._report(name, lambda: self.stub.Embed(request, timeout=self.timeout, metadata=self.metadata).ByteSize())

    def embed_stream(self, name: str, batches: list[list[str]]) -> None:
        def requests() -> Iterator[embedding_pb2.EmbedRequest]:
            for texts in batches:
                yield embedding_pb2.EmbedRequest(inputs=texts, truncate=True)

        def call() -> int:
            responses = list(self.stub.EmbedStream(requests(), timeout=self.timeout, metadata=self.metadata))
            if len(responses) != len(batches):
                raise GrpcCallFailed(grpc.StatusCode.DATA_LOSS, f"{len(responses)} of {len(batches)} answered")
            return sum(r.ByteSize() for r in responses)

        self._report(name, call)

    def model_infer(self, name: str, texts: list[str], model: str = "") -> None:
        """The Open Inference Protocol's text mode, raw contents as tritonclient sends them."""
        request = inference_pb.ModelInferRequest(model_name=model)
        request.inputs.add(name="text", datatype="BYTES", shape=[len(texts)])
        request.raw_input_contents.append(b"".join(struct.pack("<I", len(b)) + b for b in (t.encode() for t in texts)))
        request.parameters["truncate"].bool_param = True

        def call() -> int:
            response = self.model_infer_call(request, timeout=self.timeout, metadata=self.metadata)
            if list(response.outputs[0].shape)[:1] != [len(texts)]:
                raise GrpcCallFailed(grpc.StatusCode.DATA_LOSS, f"shape {list(response.outputs[0].shape)}")
            return response.ByteSize()

        self._report(name, call)
