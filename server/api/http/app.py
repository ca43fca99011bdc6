"""The HTTP front end: OpenAI's `/v1/embeddings`, text-embeddings-inference's `/embed` and `/tokenize`, and the
native routes, as a raw ASGI app served by uvicorn on the gRPC server's own event loop.

With fields.py (the requests' JSON fields) and connection.py (the HTTP/1.1 connection beneath), the only
modules that know HTTP. Requests go through the same admission, pipelines, batchers and metrics as gRPC;
``STATUS_FOR_ERROR`` here is the one table from domain errors to HTTP statuses and OpenAI's error shape.
Every route: docs/api.md.
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import json
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import orjson

from server.api.http.fields import ParamError, openai_fields, optional_field, parse_input, tei_fields, token_rows
from server.api.request_ids import REQUEST_ID as REQUEST_ID_NAME
from server.api.request_ids import RequestIds
from server.backend.ort import CUDA
from server.core.admission import Admission, Ticket
from server.core.errors import (
    BadInput,
    BodyTooLarge,
    Cancelled,
    DeadlineExceeded,
    EmbedError,
    InferenceFailed,
    Internal,
    InvalidInput,
    NotReady,
    Overloaded,
    Unauthenticated,
    UnknownModel,
    nearest_entry,
)
from server.core.pipeline import Embedded, Tokenized, validate
from server.core.registry import ServedModel, ServingState
from server.metrics import Metrics

log = logging.getLogger(__name__)


class HeadersTimedOut(InvalidInput):
    """A request's headers did not arrive within the header timeout (HTTP only: answered 408, then closed)."""


class HeadTooLarge(InvalidInput):
    """A request's line and headers over MAX_HEAD_BYTES (HTTP only: answered 431, then closed)."""


class CompressedBody(InvalidInput):
    """A body sent with a Content-Encoding (gzip, say): refused unread, since inflating it would take memory
    its admitted size does not count (HTTP only: answered 415)."""


# The one translation table from domain errors to HTTP statuses and OpenAI error types.
STATUS_FOR_ERROR: dict[type[EmbedError], tuple[int, str]] = {
    InvalidInput: (400, "invalid_request_error"),
    HeadersTimedOut: (408, "invalid_request_error"),
    HeadTooLarge: (431, "invalid_request_error"),
    CompressedBody: (415, "invalid_request_error"),
    UnknownModel: (404, "invalid_request_error"),
    BodyTooLarge: (413, "invalid_request_error"),
    Unauthenticated: (401, "authentication_error"),
    Overloaded: (429, "server_overloaded"),
    NotReady: (503, "service_unavailable"),
    DeadlineExceeded: (504, "timeout"),
    Cancelled: (499, "cancelled"),
    InferenceFailed: (500, "server_error"),
    Internal: (500, "server_error"),
}
CODE_FOR_ERROR: dict[type[EmbedError], str] = {
    UnknownModel: "model_not_found",
    BodyTooLarge: "request_too_large",
    Overloaded: "overloaded",
    Unauthenticated: "invalid_api_key",
    HeadersTimedOut: "timeout",
    HeadTooLarge: "request_headers_too_large",
    CompressedBody: "unsupported_content_encoding",
}
REASON_FOR_ERROR: dict[type[EmbedError], str] = {  # embed_rejections_total's reasons, as for gRPC
    InvalidInput: "invalid",
    UnknownModel: "invalid",
    BodyTooLarge: "invalid",
    Unauthenticated: "unauthenticated",
    Overloaded: "overloaded",
    DeadlineExceeded: "deadline",
    Cancelled: "cancelled",
}
OPENAPI = Path(__file__).parent / "openapi.json"
T = TypeVar("T")
Header = tuple[bytes, bytes]
Route = Callable[[dict[str, Any], Any, str], Awaitable[tuple[int, bytes]]]  # (scope, receive, client) -> status, body
JSON: list[Header] = [(b"content-type", b"application/json")]
DIMENSIONS_TRAINED = b"x-dimensions-trained"  # true | false, on an embeddings answer that asked for dimensions
REQUEST_ID = REQUEST_ID_NAME.encode()  # on every answer, as OpenAI's API sends it; the `openai` client reads it
EXPOSED_HEADERS = DIMENSIONS_TRAINED + b", " + REQUEST_ID  # what a browser on an allowed origin may read
MODEL_ROUTE = "/v1/models/"  # GET /v1/models/{model}: the name may hold slashes (sentence-transformers/...)
OPEN_ROUTES = ("/health", "/ready", "/openapi.json")  # GET, no token, answered while loading or draining too
CORS_HEADERS = b"authorization, content-type"  # allowed when a preflight does not list its own


def _header(scope: dict[str, Any], name: bytes) -> bytes | None:
    """A request header's value (ASGI names are lower-case), or None."""
    return next((v for k, v in scope["headers"] if k == name), None)


def _model_name(path: str) -> str | None:
    """The name in a `/v1/models/{model}` path (it may hold slashes), else None."""
    name = path.removeprefix(MODEL_ROUTE)
    return name if name and name != path else None


def _model_object(name: str, exported_at: int) -> dict[str, Any]:
    """A served model as OpenAI describes one; `created` is when it was exported."""
    return {"id": name, "object": "model", "created": exported_at, "owned_by": "embedding-service"}


def error_body(error: EmbedError) -> tuple[int, bytes]:
    status, error_type = nearest_entry(STATUS_FOR_ERROR, error, (500, "server_error"))
    param = error.param if isinstance(error, ParamError) else None
    body = {
        "error": {
            "message": str(error),
            "type": error_type,
            "param": param,
            "code": nearest_entry(CODE_FOR_ERROR, error),
        }
    }
    return status, orjson.dumps(body)


class ConnectionRequests:
    """The requests running for one connection (``scope[CONNECTION]``; the connection's protocol makes it): when the
    client goes away they are cancelled, as gRPC cancels the call of a client that leaves, so that their queued
    inputs are swept from the batcher and never computed. A request then ends as 499 (``Cancelled``)."""

    __slots__ = ("lost", "running")

    def __init__(self) -> None:
        self.running: set[asyncio.Task[Any]] = set()
        self.lost = False

    def lose(self) -> None:
        self.lost = True
        for task in self.running:
            task.cancel()


CONNECTION = "embed.connection"  # the scope's key for its connection's ConnectionRequests


@dataclass(frozen=True)
class EmbedCall:
    """What one embedding request asked for, beside its inputs."""

    model: ServedModel
    field: str  # where the inputs came from: OpenAI's `input`, TEI's `inputs`; error messages name it
    truncate: bool
    normalize: bool
    dimensions: int | None
    client: str


class HttpApi:
    """The ASGI app. ``client`` keys (admission, fair queueing) are connections, as for gRPC."""

    def __init__(
        self,
        state: ServingState,
        metrics: Metrics,
        admission: Admission,
        info: Callable[[], dict[str, Any]],
        token: str = "",
        max_body_bytes: int = 4 << 20,
        body_timeout: float = 10.0,
        auto_truncate: bool = True,
        cors_origins: Sequence[str] = (),
        max_inputs: int = 2048,
    ) -> None:
        self.state = state
        self.metrics = metrics
        self.admission = admission
        self._info = info
        self._expected = f"Bearer {token}".encode() if token else b""
        self.max_body_bytes = max_body_bytes
        self.body_timeout = body_timeout
        self.auto_truncate = auto_truncate
        self.max_inputs = max_inputs  # per /v1/embeddings request; beyond the pipeline's own limit, in parts
        self._cors_any = "*" in cors_origins
        self._cors_origins = frozenset(origin.encode() for origin in cors_origins)
        self._routes: dict[tuple[str, str], Route] = {
            ("POST", "/v1/embeddings"): self._embeddings,
            ("POST", "/embed"): self._embed,
            ("POST", "/"): self._embed,  # TEI answers embeddings at its root too (huggingface_hub posts there)
            ("GET", "/v1/models"): self._models,
            ("GET", "/info"): self._info_route,
            ("POST", "/tokenize"): self._tokenize,
        }
        self._openapi = OPENAPI.read_bytes()
        self._request_ids = RequestIds()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":  # lifespan is off; websockets are not served
            return
        method, path = scope["method"], scope["path"]
        if method == "HEAD":  # GET's answer without its body (RFC 9110, 9.3.2): uvicorn drops the body
            method = "GET"
        origin = self._cors_origin(scope) if self._cors_origins else None
        if method == "OPTIONS" and origin is not None:
            await self._preflight(scope, send, origin)
            return
        request_id = self._request_ids(_header(scope, REQUEST_ID))
        if path in OPEN_ROUTES and method == "GET":
            status, body = self._open_route(path)
            await _respond(send, status, body, self.state.draining, origin, [(REQUEST_ID, request_id)])
            return
        route, label = self._route(method, path)
        if route is None:
            allowed = self._methods_of(path)
            status, body = self._no_route(scope["method"], path, allowed)
            # A 405 names the methods the path takes (RFC 9110, 15.5.6).
            extra = [(b"allow", ", ".join(allowed).encode())] if allowed else []
            await _respond(send, status, body, self.state.draining, origin, [*extra, (REQUEST_ID, request_id)])
            return
        started = time.perf_counter()
        self.state.request_started()
        connection: ConnectionRequests | None = scope.get(CONNECTION)
        task = asyncio.current_task()
        if connection is not None and task is not None:
            connection.running.add(task)
        try:
            self._authorize(scope)
            host, port = scope.get("client") or ("?", 0)
            client = f"http:{host}:{port}"
            status, body = await route(scope, receive, client)
        except asyncio.CancelledError:
            if connection is None or not connection.lost or task is None:
                raise  # not the client's leaving: the server's own shutdown
            task.uncancel()
            status, body = self._refused(Cancelled("the client went away"), scope, label, request_id)
        except Exception as e:
            status, body = self._refused(e, scope, label, request_id)
        finally:
            self.state.request_finished()
            if connection is not None and task is not None:
                connection.running.discard(task)
        model = scope.get("embed.model", "")
        self.metrics.answered("http", label, str(status), model, time.perf_counter() - started)
        answer_headers: list[Header] = scope.get("embed.headers", []) if status == 200 else []
        answer_headers.append((REQUEST_ID, request_id))
        await _respond(send, status, body, self.state.draining, origin, answer_headers)

    def _refused(self, error: Exception, scope: dict[str, Any], label: str, request_id: bytes) -> tuple[int, bytes]:
        """A request's failure, counted, as its status and body."""
        domain = error if isinstance(error, EmbedError) else _internal(error, label)
        self._count_refusal(domain, scope.get("embed.model", ""))
        status, body = error_body(domain)
        if status == 500:  # the failure itself is logged where it happened; this line names the request
            log.warning("%s answered 500 to request %s: %s", label, request_id.decode(), domain)
        return status, body

    def _route(self, method: str, path: str) -> tuple[Route | None, str]:
        """The handler of a request, and its name in the metrics' method label."""
        route = self._routes.get((method, path))
        if route is None and method == "GET" and _model_name(path) is not None:
            return self._model, "GET /v1/models/{model}"  # one series, whatever names clients try
        return route, f"{method} {path}"

    def _methods_of(self, path: str) -> list[str]:
        methods = {m for m, p in self._routes if p == path}
        if path in OPEN_ROUTES or _model_name(path) is not None:
            methods.add("GET")
        return sorted(methods | ({"HEAD"} if "GET" in methods else set()))

    def _no_route(self, method: str, path: str, allowed: list[str]) -> tuple[int, bytes]:
        if allowed:
            message, status, code = f"{path} takes {' or '.join(allowed)}, not {method}", 405, "method_not_allowed"
        else:
            message, status, code = f"no route {method} {path}{self._did_you_mean(method, path)}", 404, "not_found"
        error = {"message": message, "type": "invalid_request_error", "param": None, "code": code}
        return status, orjson.dumps({"error": error})

    def _did_you_mean(self, method: str, path: str) -> str:
        """A hint for the usual slips: a base URL without /v1, or a trailing slash."""
        for candidate in (path.rstrip("/"), "/v1" + path.rstrip("/")):
            if candidate != path and self._route(method, candidate)[0] is not None:
                return f"; did you mean {method} {candidate}? (an OpenAI client's base_url ends in /v1)"
        return ""

    # ---- browsers on other origins (CORS) ----------------------------------------------------
    def _cors_origin(self, scope: dict[str, Any]) -> bytes | None:
        """The request's Origin when --http-cors-origins allows it; b"" when it names another; None without one."""
        origin = _header(scope, b"origin")
        if origin is None:
            return None
        return origin if self._cors_any or origin in self._cors_origins else b""

    async def _preflight(self, scope: dict[str, Any], send: Any, origin: bytes) -> None:
        """A browser asks before a cross-origin POST with a JSON body or an Authorization header."""
        if not origin:
            message = "this origin may not call the API from a browser (--http-cors-origins)"
            error = {"message": message, "type": "permission_error", "param": None, "code": "origin_not_allowed"}
            await _respond(send, 403, orjson.dumps({"error": error}), self.state.draining)
            return
        asked = _header(scope, b"access-control-request-headers") or CORS_HEADERS
        headers = [
            (b"access-control-allow-origin", origin),
            (b"access-control-allow-methods", b"GET, POST, OPTIONS"),
            (b"access-control-allow-headers", asked),
            (b"access-control-max-age", b"600"),
            (b"vary", b"origin"),
            (b"content-length", b"0"),
        ]
        await send({"type": "http.response.start", "status": 204, "headers": headers})
        await send({"type": "http.response.body", "body": b""})

    # ---- routes -----------------------------------------------------------------------------
    def _open_route(self, path: str) -> tuple[int, bytes]:
        if path == "/health":
            return 200, b'{"status":"ok"}'
        if path == "/openapi.json":
            return 200, self._openapi
        ready = self.state.ready and self.state.healthy
        reason = "ready" if ready else ("draining" if self.state.draining else "not ready")
        return (200 if ready else 503), orjson.dumps({"status": reason})

    async def _models(self, scope: dict[str, Any], receive: Any, client: str) -> tuple[int, bytes]:
        self.state.resolve("")  # NotReady while loading
        data = [_model_object(name, model.info.exported_at) for name, model in self.state.models.items()]
        return 200, orjson.dumps({"object": "list", "data": data})

    async def _model(self, scope: dict[str, Any], receive: Any, client: str) -> tuple[int, bytes]:
        """OpenAI's retrieve: one model by a name it is served under (uvicorn has decoded a %2F to /)."""
        model = self.state.resolve(scope["path"].removeprefix(MODEL_ROUTE))  # _route sends only such paths
        scope["embed.model"] = model.name
        return 200, orjson.dumps(_model_object(model.name, model.info.exported_at))

    async def _info_route(self, scope: dict[str, Any], receive: Any, client: str) -> tuple[int, bytes]:
        self.state.resolve("")
        return 200, orjson.dumps(self._info())

    async def _tokenize(self, scope: dict[str, Any], receive: Any, client: str) -> tuple[int, bytes]:
        """TEI's `/tokenize`: what the model would read, token by token, before truncation."""
        body, tickets = await self._read_json(scope, receive, client)
        try:
            model = self.state.resolve(optional_field(body, "model", str, "") or "")
            scope["embed.model"] = model.name
            inputs = body.get("inputs")
            texts = [inputs] if isinstance(inputs, str) else inputs
            if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
                raise ParamError("'inputs' must be a string or a non-empty list of strings", "inputs")
            add_special_tokens = optional_field(body, "add_special_tokens", bool, True)
        finally:
            del body
            for ticket in tickets:
                ticket.release()
        try:
            return 200, orjson.dumps(await model.pipeline.tokens(texts, add_special_tokens))
        except BadInput as e:  # TEI's field is `inputs`
            raise ParamError(f"inputs[{e.index}] {e.problem}", "inputs") from None

    async def _embeddings(self, scope: dict[str, Any], receive: Any, client: str) -> tuple[int, bytes]:
        """OpenAI's `/v1/embeddings`."""
        call, rows, tokens, encoding, _ = await self._embedded(scope, receive, client, "input", openai_fields)
        if encoding == "base64":
            embeddings: list[Any] = [base64.b64encode(row.tobytes()).decode() for row in rows]
        else:
            embeddings = list(rows)
        response = {
            "object": "list",
            "data": [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(embeddings)],
            "model": call.model.name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
        return 200, orjson.dumps(response, option=orjson.OPT_SERIALIZE_NUMPY)

    async def _embed(self, scope: dict[str, Any], receive: Any, client: str) -> tuple[int, bytes]:
        """text-embeddings-inference's `/embed` (and `/`): `inputs` in, a bare list of float vectors out, and
        TEI's headers saying what the request cost (its clients' benchmarks read them)."""
        started = time.perf_counter()
        call, rows, tokens, characters, parts = await self._embedded(scope, receive, client, "inputs", tei_fields)
        body = orjson.dumps(rows, option=orjson.OPT_SERIALIZE_NUMPY)
        total = _whole_ms(time.perf_counter() - started)
        compute_type = b"gpu" if call.model.info.execution_provider == CUDA else b"cpu"
        tokenizing = _whole_ms(sum(part.tokenize_seconds for part in parts))
        queued = _whole_ms(sum(part.queue_seconds for part in parts))
        inference = _whole_ms(sum(part.inference_seconds for part in parts))
        scope.setdefault("embed.headers", []).extend(
            [(b"x-compute-type", compute_type), (b"x-compute-time", total),
             (b"x-compute-characters", b"%d" % characters), (b"x-compute-tokens", b"%d" % tokens),
             (b"x-total-time", total), (b"x-tokenization-time", tokenizing), (b"x-queue-time", queued),
             (b"x-inference-time", inference)]
        )  # fmt: skip
        return 200, body

    async def _embedded(
        self, scope: dict[str, Any], receive: Any, client: str, field: str, own_fields: Callable[[dict[str, Any]], T]
    ) -> tuple[EmbedCall, np.ndarray, int, T, list[Embedded]]:
        """The embedding routes' shared work: the body read and admitted, the fields both routes share read
        (``own_fields`` reads the route's own), the inputs of ``field`` embedded, in parts beyond the
        pipeline's limit. Returns the call, the embeddings (float32 rows), their token count, what
        ``own_fields`` returned, and the pipeline's answer to each part (one, unless the request ran in parts)."""
        body, tickets = await self._read_json(scope, receive, client)
        parts: list[Embedded] | None = None  # a request run in parts: the answer to each
        try:
            model = self.state.resolve(optional_field(body, "model", str, "") or "")
            scope["embed.model"] = model.name  # for the metrics' model label
            inputs = parse_input(body.get(field), field)
            if len(inputs) > self.max_inputs:  # OpenAI's clients split lists by a size
                most = self.max_inputs
                raise ParamError(f"'{field}' holds {len(inputs)} items, more than {most}; send at most {most} a "
                                 "request (LangChain's chunk_size, LlamaIndex's embed_batch_size)", field)  # fmt: skip
            own = own_fields(body)
            dimensions = optional_field(body, "dimensions", int, None)
            if dimensions is not None and not 1 <= dimensions <= model.info.dim:
                raise ParamError(f"'dimensions' must be between 1 and {model.info.dim}, not {dimensions}", "dimensions")
            if dimensions is not None:  # neither answer has a place for it: a header says whether it was trained
                trained = b"true" if model.info.trained_at(dimensions) else b"false"
                scope["embed.headers"] = [(DIMENSIONS_TRAINED, trained)]
            normalize = optional_field(body, "normalize", bool, True)
            truncate = optional_field(body, "truncate", bool, self.auto_truncate)
            call = EmbedCall(model, field, truncate, normalize, dimensions, client)
            if len(inputs) > model.pipeline.limits.max_client_batch_size:
                # Within this block its body's places stay held (its memory is that of a call reading a
                # body) until the last part is answered.
                parts = await self._in_parts(call, inputs)
            else:
                tokenized = await self._tokenized(call, inputs)
        finally:
            del body
            for ticket in tickets:
                ticket.release()  # a request of the pipeline's size: only its token rows wait for the batch
        if parts is None:
            parts = [await model.pipeline.compute(tokenized, normalize, None, client, dimensions)]
        rows = parts[0].embeddings if len(parts) == 1 else np.concatenate([part.embeddings for part in parts])
        tokens = sum(sum(part.token_counts) for part in parts)
        return call, np.ascontiguousarray(rows, dtype="<f4"), tokens, own, parts

    async def _tokenized(self, call: EmbedCall, inputs: list[Any], first: int = 0) -> Tokenized:
        """Texts tokenized, or token id rows checked, as one request of the pipeline's size; ``first`` is the
        index of ``inputs[0]`` in the request, for the messages."""
        if not isinstance(inputs[0], str):
            return Tokenized(token_rows(inputs, call.model, call.field), [], 0.0)
        try:
            return await call.model.pipeline.tokenize(inputs, call.truncate, call.client)
        except BadInput as e:  # the request's field (`input`), where gRPC's message names `inputs`
            raise ParamError(f"{call.field}[{first + e.index}] {e.problem}", call.field) from None

    async def _in_parts(self, call: EmbedCall, inputs: list[Any]) -> list[Embedded]:
        """A request over the pipeline's limit, as consecutive requests of that size: the same queue, fairness
        and refusals as separate requests, one part in the queue at a time. A client that goes away stops it."""
        pipeline = call.model.pipeline
        part = pipeline.limits.max_client_batch_size
        starts = range(0, len(inputs), part)
        texts = isinstance(inputs[0], str)
        rows = [] if texts else token_rows(inputs, call.model, call.field)  # checked and made once, for every part
        try:  # the cheap checks of every text first, so that a bad one costs no computing
            for start in starts if texts else ():
                validate(inputs[start : start + part], pipeline.limits)
        except BadInput as e:
            raise ParamError(f"{call.field}[{start + e.index}] {e.problem}", call.field) from None
        answers = []
        for start in starts:  # a client that goes away cancels this (ConnectionRequests): no later part starts
            if texts:
                tokenized = await self._tokenized(call, inputs[start : start + part], start)
            else:
                tokenized = Tokenized(rows[start : start + part], [], 0.0)
            answers.append(await pipeline.compute(tokenized, call.normalize, None, call.client, call.dimensions))
        return answers

    # ---- reading a request ------------------------------------------------------------------
    def _authorize(self, scope: dict[str, Any]) -> None:
        if not self._expected:
            return
        given = _header(scope, b"authorization") or b""
        if not hmac.compare_digest(given, self._expected):  # constant time: no timing oracle
            raise Unauthenticated("missing or invalid bearer token (header 'Authorization: Bearer <token>')")

    async def _read_json(self, scope: dict[str, Any], receive: Any, client: str) -> tuple[dict[str, Any], list[Ticket]]:
        """The body, admitted before it is read: by its connection, then by its Content-Length. A chunked
        body (no length) is admitted as the largest body this server reads and cut off past it."""
        encoding = (_header(scope, b"content-encoding") or b"identity").strip().lower()
        if encoding != b"identity":
            name = encoding.decode("latin-1")
            raise CompressedBody(f"the body is sent with Content-Encoding {name!r}; send it uncompressed")
        length_header = _header(scope, b"content-length")
        if length_header is not None:
            try:
                length = int(length_header)
            except ValueError:
                raise ParamError("Content-Length is not a number", "body") from None
            if length > self.max_body_bytes:
                raise BodyTooLarge(f"the body has {length} bytes, more than this server reads ({self.max_body_bytes})")
        else:  # HTTP/1.1: neither Content-Length nor chunked means no body
            chunked = b"chunked" in (_header(scope, b"transfer-encoding") or b"").lower()
            length = self.max_body_bytes if chunked else 0
        tickets = [self.admission.enter(client)]
        try:
            tickets.append(self.admission.receive(length))
            chunks, got = [], 0
            more = True
            try:
                # One deadline for the whole body, so a trickle of bytes cannot hold its place; and no task
                # per request, as asyncio.wait_for would make.
                async with asyncio.timeout(self.body_timeout):
                    while more:
                        message = await receive()
                        if message["type"] == "http.disconnect":
                            raise Cancelled("the client went away")
                        chunk = message.get("body", b"")
                        got += len(chunk)
                        if got > length:
                            if length_header is None:
                                raise BodyTooLarge(f"the body has more than {length} bytes, the most this server reads")
                            raise ParamError("the body is longer than its Content-Length", "body")
                        chunks.append(chunk)
                        more = message.get("more_body", False)
            except TimeoutError:
                raise ParamError(f"the body did not arrive within {self.body_timeout:g} s", "body") from None
            try:
                body = orjson.loads(b"".join(chunks))
            except orjson.JSONDecodeError as e:
                raise ParamError(f"the body is not valid JSON: {e}", "body") from None
            if not isinstance(body, dict):
                raise ParamError("the body must be a JSON object", "body")
            return body, tickets
        except BaseException:
            for ticket in tickets:
                ticket.release()
            raise

    def _count_refusal(self, error: EmbedError, model: str) -> None:
        """Counts a refusal by reason, against the model the request named (empty before one was resolved)."""
        reason = nearest_entry(REASON_FOR_ERROR, error)
        if isinstance(error, NotReady):
            reason = "draining" if self.state.draining else "not_ready"
        if reason is not None:
            self.metrics.rejected(reason, model)


def _whole_ms(seconds: float) -> bytes:
    """TEI's unit for its timing headers: whole milliseconds, rounded down."""
    return b"%d" % int(seconds * 1000)


def _internal(error: Exception, route: str) -> Internal:
    log.error("unexpected error in %s", route, exc_info=error)
    return Internal(f"internal error ({type(error).__name__}); the server log has the details")


async def _respond(
    send: Any, status: int, body: bytes, draining: bool, origin: bytes | None = None, extra: Sequence[Header] = ()
) -> None:
    headers = [*JSON, (b"content-length", b"%d" % len(body)), *extra]
    if draining:  # the client's next request opens a new connection, to a server still in rotation
        headers.append((b"connection", b"close"))
    if origin:  # a browser on an allowed origin may read the answer, our own header included
        headers += [(b"access-control-allow-origin", origin), (b"vary", b"origin")]
        headers += [(b"access-control-expose-headers", EXPOSED_HEADERS)]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def openapi_document() -> dict[str, Any]:
    return dict(json.loads(OPENAPI.read_text()))
