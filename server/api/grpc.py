"""The gRPC Embedder service (protos/embedding/v1/embedding.proto): Embed, EmbedStream and Info."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import numpy as np

from embedding.v1 import embedding_pb2, embedding_pb2_grpc
from server.api.rpc import Call, Received, RpcAccounting, deadline_of, receiving, release_when_done, status_for
from server.core.admission import Admission
from server.core.errors import EmbedError, Overloaded
from server.core.pipeline import Embedded
from server.core.registry import ModelInfo, ServingState
from server.metrics import Metrics

SERVICE_NAME = embedding_pb2.DESCRIPTOR.services_by_name["Embedder"].full_name
DESCRIBED_FIELDS = (
    "model_id",
    "model_version",
    "dim",
    "max_input_length",
    "execution_provider",
    "precision",
    "max_batch_tokens",
)
STREAM_WINDOW = 16  # requests of one stream computed concurrently; reading pauses beyond that


def add_to_server(service: EmbedderService, server: grpc.aio.Server, admission: Admission) -> None:
    """Like the generated add_EmbedderServicer_to_server, with every body admitted before it is parsed.

    Embed is registered request-streaming (the wire is the same as a unary call's): gRPC reads a unary
    call's message before any handler code runs, so only this way can the handler admit the call by
    its connection first and refuse it unread (``RpcAccounting._admitted``).
    """
    pb = embedding_pb2
    handlers = {
        "Embed": grpc.stream_unary_rpc_method_handler(
            service.Embed, receiving(pb.EmbedRequest.FromString, admission), pb.EmbedResponse.SerializeToString
        ),
        "EmbedStream": grpc.stream_stream_rpc_method_handler(
            service.EmbedStream,
            receiving(pb.EmbedRequest.FromString, admission),
            pb.EmbedResponse.SerializeToString,
        ),
        "Info": grpc.unary_unary_rpc_method_handler(
            service.Info, receiving(pb.InfoRequest.FromString, admission), pb.InfoResponse.SerializeToString
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


@functools.cache
def _row_prefix(dim: int) -> bytes:
    """The bytes before a row's floats in a serialized EmbedResponse: the same for every row of a width.

    Taken from protobuf's own serialization of one zero row (its floats are the last 4 x dim bytes).
    """
    one_row = embedding_pb2.EmbedResponse(embeddings=[embedding_pb2.Embedding(values=[0.0] * dim)])
    return one_row.SerializeToString()[: -4 * dim]


def embeddings_message(embeddings: np.ndarray) -> embedding_pb2.EmbedResponse:
    """An EmbedResponse holding these (n, dim) rows, parsed from their wire format.

    A repeated float field is packed little-endian float32 on the wire, so each row is a fixed prefix
    and its array's bytes: no Python float per value.
    """
    rows = np.ascontiguousarray(embeddings, dtype="<f4")
    if len(rows) == 0:
        return embedding_pb2.EmbedResponse()
    prefix = _row_prefix(rows.shape[1])
    return embedding_pb2.EmbedResponse.FromString(prefix + prefix.join([row.tobytes() for row in rows]))


def to_response(result: Embedded, total_seconds: float, model: str) -> embedding_pb2.EmbedResponse:
    response = embeddings_message(result.embeddings)
    response.model = model
    response.token_counts.extend(result.token_counts)
    response.total_tokens = sum(result.token_counts)
    response.truncated_inputs.extend(result.truncated)
    timings = response.timings
    timings.tokenization_seconds = result.tokenize_seconds
    timings.queue_seconds = result.queue_seconds
    timings.inference_seconds = result.inference_seconds
    timings.total_seconds = total_seconds
    return response


def describe(info: ModelInfo, message: Any) -> None:
    """The fields InfoResponse and ModelDescription share, from one model's info."""
    for field in DESCRIBED_FIELDS:
        setattr(message, field, getattr(info, field))


class EmbedderService(RpcAccounting, embedding_pb2_grpc.EmbedderServicer):
    def __init__(
        self,
        state: ServingState,
        metrics: Metrics,
        batching: embedding_pb2.InfoResponse,
        admission: Admission,
        max_streams: int = 64,
    ) -> None:
        super().__init__(state, metrics, admission)
        self._batching = batching  # the limits part of Info, fixed at start
        self._max_streams = max_streams
        self._open_streams = 0

    async def _embed(
        self, received: Received, context: grpc.aio.ServicerContext, call: Call
    ) -> embedding_pb2.EmbedResponse:
        request = received.take()
        model = self._admit(request, call)
        started = time.perf_counter()
        deadline = deadline_of(context)
        normalize = request.normalize if request.HasField("normalize") else True
        dimensions = request.dimensions if request.HasField("dimensions") else None
        client = call.client
        # The message's own sequence, not a list copy: with truncation on, only cut prefixes are kept.
        tokenized = await model.pipeline.tokenize(request.inputs, request.truncate, client)
        del request  # only the token rows wait for the batch: the body's memory and places go now
        received.release()
        result = await model.pipeline.compute(tokenized, normalize, deadline, client, dimensions)
        response = to_response(result, time.perf_counter() - started, model.name)
        if dimensions is not None:
            response.dimensions_trained = model.info.trained_at(dimensions)
        return response

    async def Embed(
        self, requests: AsyncIterator[Received], context: grpc.aio.ServicerContext
    ) -> embedding_pb2.EmbedResponse:
        return await self._admitted("Embed", context, lambda call, received: self._embed(received, context, call))

    async def EmbedStream(
        self, request_iterator: AsyncIterator[Received], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[embedding_pb2.EmbedResponse]:
        """Requests are computed concurrently (up to STREAM_WINDOW) and answered in order."""
        client = context.peer()  # before the first await: the RPC is still running (Call.client)
        if self._open_streams >= self._max_streams:
            self.metrics.rejected("overloaded")
            self.metrics.requests.labels("grpc", "EmbedStream", grpc.StatusCode.RESOURCE_EXHAUSTED.name, "").inc()
            details = f"{self._open_streams} streams open, the limit; retry later"
            await self._refuse(context, "EmbedStream", status_for(Overloaded("")), details)
        self._open_streams += 1
        # The semaphore bounds the requests computing at once; a task is created only once it holds a
        # place, so a stream cancelled while its reader waits for room leaves no task behind.
        window = asyncio.Semaphore(STREAM_WINDOW)
        pending: asyncio.Queue[asyncio.Task[embedding_pb2.EmbedResponse] | None] = asyncio.Queue()

        async def one(received: Received) -> embedding_pb2.EmbedResponse:
            with self._observe("EmbedStream", context) as call:
                call.client = client
                try:
                    return await self._embed(received, context, call)
                except Exception as e:
                    raise self._failed(e, "EmbedStream", call) from None

        async def read() -> None:
            try:
                async for request in request_iterator:
                    try:
                        await window.acquire()
                    except BaseException:  # the stream ends while this request waits for room: its body goes
                        request.release()
                        raise
                    task = asyncio.create_task(one(request))
                    # Released when the task is done, also when it is cancelled before it starts (the stream
                    # ended): then one() never runs, and its body would wait for the garbage collector.
                    task.add_done_callback(functools.partial(release_when_done, request))
                    pending.put_nowait(task)
            finally:
                pending.put_nowait(None)

        reader = asyncio.create_task(read())
        position = 0
        try:
            while (task := await pending.get()) is not None:
                try:
                    response = await task
                except EmbedError as e:
                    await self._refuse(context, "EmbedStream", status_for(e), f"stream request {position}: {e}")
                window.release()
                yield response
                position += 1
            await reader  # surfaces a failure to read the stream
        finally:
            self._open_streams -= 1
            reader.cancel()
            while not pending.empty():
                task = pending.get_nowait()
                if task is not None:
                    task.cancel()

    async def Info(self, received: Received, context: grpc.aio.ServicerContext) -> embedding_pb2.InfoResponse:
        return await self._unary("Info", received, context, lambda call: self._info(received.take(), call))

    async def _info(self, request: embedding_pb2.InfoRequest, call: Call) -> embedding_pb2.InfoResponse:
        info = self.state.resolve(request.model).info
        call.model = info.name
        response = embedding_pb2.InfoResponse(model=info.name, version=info.version)
        response.MergeFrom(self._batching)
        describe(info, response)
        for i, model in enumerate(self.state.models.values()):
            description = response.models.add(name=model.name, is_default=i == 0)
            describe(model.info, description)
            description.trained_dimensions.extend(model.info.trained_dimensions)
        return response

    def set_limits(self, limits: embedding_pb2.InfoResponse) -> None:
        """The serving limits Info reports, once the memory plan is known (after loading)."""
        self._batching = limits
