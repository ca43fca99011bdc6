"""The HTTP API, called by the official `openai` client, by curl and by raw sockets, against a real server."""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import select
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jsonschema
import numpy as np
import openai
import pytest
from huggingface_hub import InferenceClient

from server.api.http.app import openapi_document
from tests.conftest import (
    GENERATED_ID,
    GatedBackend,
    ServerThread,
    counter,
    eventually,
    read_response,
    request,
    server_config,
)

TOKEN = "s3cret-http"
SCHEMAS = openapi_document()


def schema(name: str) -> dict:  # type: ignore[type-arg]
    return {"$ref": f"#/components/schemas/{name}", "components": SCHEMAS["components"]}


def conforms(body: dict, name: str) -> None:  # type: ignore[type-arg]
    jsonschema.validate(body, schema(name))


@pytest.fixture(scope="module")
def served_http(tiny_artifacts: Path) -> Iterator[ServerThread]:
    server = ServerThread(server_config(tiny_artifacts, auth_token=TOKEN, max_client_batch_size=8, http_max_inputs=20))
    yield server
    server.stop()


def base_url(server: ServerThread) -> str:
    return f"http://127.0.0.1:{server.server.http_port}"


def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url(server)}/v1", api_key=TOKEN, max_retries=0)


def post(server: ServerThread, body: object, token: str = TOKEN, path: str = "/v1/embeddings") -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(base_url(server) + path, content=content, headers=headers, timeout=20)


def grpc_embeddings(server: ServerThread, *texts: str) -> np.ndarray:
    response = server.stub().Embed(request(*texts), metadata=[("authorization", f"Bearer {TOKEN}")], timeout=10)
    return np.array([e.values for e in response.embeddings])


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(axis=1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


TEXTS = ["the cat sat on the mat", "a river runs through the valley"]


def test_the_openai_client_gets_the_grpc_embeddings_by_base64_and_by_float(served_http: ServerThread) -> None:
    expected = grpc_embeddings(served_http, *TEXTS)
    openai_client = client(served_http)
    default = openai_client.embeddings.create(input=TEXTS, model="")  # numpy installed: base64 on the wire
    floats = openai_client.embeddings.create(input=TEXTS, model="", encoding_format="float")
    for response in (default, floats):
        got = np.array([d.embedding for d in response.data])
        assert got.shape == expected.shape
        assert cosines(got, expected).min() >= 0.99999
        assert [d.index for d in response.data] == [0, 1]
    tokenizer = served_http.server.default.tokenizer
    tokens = sum(len(tokenizer.truncating.encode(t).ids) for t in TEXTS)
    assert default.usage.prompt_tokens == default.usage.total_tokens == tokens  # real token counts
    assert default.model == served_http.server.default.name


def test_token_ids_give_the_same_embedding_as_their_text(served_http: ServerThread) -> None:
    tokenizer = served_http.server.default.tokenizer
    ids = [tokenizer.truncating.encode(t).ids for t in TEXTS]
    by_text = post(served_http, {"input": TEXTS}).json()
    by_ids = post(served_http, {"input": ids}).json()
    one = post(served_http, {"input": ids[0]}).json()  # a single list of ids
    conforms(by_ids, "EmbeddingResponse")
    text_rows = np.array([d["embedding"] for d in by_text["data"]])
    np.testing.assert_allclose(np.array([d["embedding"] for d in by_ids["data"]]), text_rows, atol=1e-6)
    np.testing.assert_allclose(one["data"][0]["embedding"], text_rows[0], atol=1e-6)
    assert by_ids["usage"]["total_tokens"] == sum(len(r) for r in ids)


def test_dimensions_keep_the_first_components_renormalised(served_http: ServerThread) -> None:
    raw = np.array(post(served_http, {"input": TEXTS, "normalize": False}).json()["data"][0]["embedding"])
    short = post(served_http, {"input": TEXTS, "dimensions": 8}).json()
    conforms(short, "EmbeddingResponse")
    first = np.array(short["data"][0]["embedding"])
    assert first.shape == (8,)
    assert abs(np.linalg.norm(first) - 1.0) < 1e-5  # unit length, unlike a cut of the normalised vector
    np.testing.assert_allclose(first, raw[:8] / np.linalg.norm(raw[:8]), atol=1e-5)
    for bad in (0, 33, "8"):
        response = post(served_http, {"input": TEXTS, "dimensions": bad})
        assert response.status_code == 400 and response.json()["error"]["param"] == "dimensions"


def test_head_answers_what_get_answers_without_the_body(served_http: ServerThread) -> None:
    """RFC 9110 asks every server for HEAD where it serves GET: probes and monitors send it."""
    headers = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=base_url(served_http), timeout=10) as http:  # one keep-alive connection
        for path, token in (("/health", {}), ("/ready", {}), ("/v1/models", headers), ("/info", headers)):
            got, head = http.get(path, headers=token), http.head(path, headers=token)
            assert (head.status_code, head.content) == (200, b""), path
            assert head.headers["content-length"] == got.headers["content-length"] == str(len(got.content)), path
        assert http.head("/v1/models").status_code == 401  # the same bearer token as GET
        refused = http.head("/v1/embeddings")
        assert (refused.status_code, refused.headers["allow"], refused.content) == (405, "POST", b"")
        assert http.get("/health").json() == {"status": "ok"}  # the connection's next answer is intact


def test_tei_clients_get_the_same_embeddings_from_embed_and_the_root(served_http: ServerThread) -> None:
    """text-embeddings-inference's route, called by huggingface_hub's InferenceClient at a server's base URL
    and at /embed: `inputs` in, a bare list of vectors out, equal to /v1/embeddings; the same dimensions,
    parts and limits, with errors that name TEI's fields."""
    want = np.array([d["embedding"] for d in post(served_http, {"input": TEXTS}).json()["data"]])
    for url in (base_url(served_http), base_url(served_http) + "/embed"):
        got = InferenceClient(model=url, token=TOKEN).feature_extraction(TEXTS)
        np.testing.assert_allclose(got, want, atol=1e-6)
    raw = InferenceClient(model=base_url(served_http), token=TOKEN).feature_extraction(TEXTS[0], normalize=False)
    assert raw.shape == (1, want.shape[1]) and not np.isclose(np.linalg.norm(raw), 1.0, atol=1e-3)
    short = post(served_http, {"inputs": TEXTS, "dimensions": 8}, path="/embed")
    conforms(short.json(), "EmbedResponse")
    assert short.headers["x-dimensions-trained"] in ("true", "false")
    np.testing.assert_allclose(np.linalg.norm(np.array(short.json()), axis=1), 1.0, atol=1e-5)
    many = [f"text number {i}" for i in range(11)]  # over the pipeline's 8: embedded in parts
    by_openai = [d["embedding"] for d in post(served_http, {"input": many}).json()["data"]]
    np.testing.assert_allclose(post(served_http, {"inputs": many}, path="/embed").json(), by_openai, atol=1e-6)
    blank = post(served_http, {"inputs": [*many, " "]}, path="/embed").json()["error"]
    assert (blank["message"], blank["param"]) == ("inputs[11] is empty or only whitespace", "inputs")
    for field, value in (("truncation_direction", "left"), ("prompt_name", "query"), ("inputs", None)):
        refused = post(served_http, {"inputs": "ok", field: value}, path="/embed")
        assert refused.status_code == 400 and refused.json()["error"]["param"] == field, refused.text
    assert post(served_http, {"inputs": "ok", "truncation_direction": "Right"}, path="/embed").status_code == 200


TEI_TIMES = ("x-total-time", "x-tokenization-time", "x-queue-time", "x-inference-time")


def test_embed_answers_say_what_they_cost_in_teis_headers(served_http: ServerThread) -> None:
    """TEI's headers on `/embed`: its clients' benchmarks read them. Whole milliseconds; a batch held 80 ms in the
    backend shows in the inference and total times; tokens and characters count every part of a long request."""
    texts = [f"text number {i}" for i in range(11)]  # over the pipeline's 8: two parts
    tokens = post(served_http, {"input": texts}).json()["usage"]["total_tokens"]
    gate = GatedBackend(served_http.server)

    def release_80_ms_after_the_first_batch_arrives() -> None:
        eventually(lambda: gate.held >= 1, what="the request's first batch in the backend")
        time.sleep(0.08)
        gate.release()

    releasing = threading.Thread(target=release_80_ms_after_the_first_batch_arrives)
    releasing.start()
    try:
        answer = post(served_http, {"inputs": texts}, path="/embed")
    finally:
        releasing.join()
        gate.remove()
    assert answer.status_code == 200
    headers = answer.headers
    provider = served_http.server.state.resolve("").info.execution_provider
    assert headers["x-compute-type"] == ("gpu" if provider == "CUDAExecutionProvider" else "cpu")
    assert int(headers["x-compute-tokens"]) == tokens
    assert int(headers["x-compute-characters"]) == sum(len(t) for t in texts)
    total, tokenizing, queued, inference = (int(headers[name]) for name in TEI_TIMES)
    assert headers["x-compute-time"] == headers["x-total-time"]
    assert inference >= 80 and total >= inference and min(tokenizing, queued) >= 0
    documented = SCHEMAS["paths"]["/embed"]["post"]["responses"]["200"]["headers"]
    for name, documentation in documented.items():  # each as /openapi.json describes it
        schema = SCHEMAS["components"]["headers"][documentation["$ref"].rsplit("/", 1)[1]]["schema"]
        if name != "x-dimensions-trained":  # only when the request asks for dimensions
            jsonschema.validate(headers[name], schema)
    assert not any(name in post(served_http, {"input": texts}).headers for name in TEI_TIMES)  # OpenAI's route: none


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (b"{not json", 400, "body"),
        (b"[1, 2]", 400, "body"),
        ({"input": 5}, 400, "input"),
        ({"input": []}, 400, "input"),
        ({"input": ["ok", 3]}, 400, "input"),
        ({"input": [[1, 2], []]}, 400, "input"),
        ({"input": [[10**9]]}, 400, "input"),
        ({"input": "ok", "encoding_format": "int8"}, 400, "encoding_format"),
        ({"input": "ok", "model": 7}, 400, "model"),
        ({"input": ["x"] * 21}, 400, "input"),
        ({"input": [[2, 3]] * 21}, 400, "input"),
        ({"input": ["ok", ""]}, 400, "input"),
        ({"input": "ok " * 200, "truncate": False}, 400, "input"),
        ({"input": "ok", "model": "no-such-model"}, 404, None),
    ],
)
def test_bad_requests_get_openai_errors_with_their_status(served_http: ServerThread, body, status, param) -> None:  # type: ignore[no-untyped-def]
    response = post(served_http, body)
    assert response.status_code == status, response.text
    error = response.json()
    conforms(error, "Error")
    assert error["error"]["param"] == param
    assert "Traceback" not in response.text
    if param == "input" and isinstance(body, dict) and isinstance(body["input"], (str, list)):
        assert "inputs" not in error["error"]["message"], error  # OpenAI's field is `input`, not gRPC's `inputs`


@pytest.mark.parametrize(
    ("body", "said"),
    [({"input": 5}, "a number"), ({"input": {"text": "ok"}}, "an object"), ({"input": True}, "a boolean"),
     ({"input": []}, "an empty list"), ({"input": None}, "missing or null"), ({}, "missing or null")],
)  # fmt: skip
def test_an_input_of_the_wrong_kind_is_told_what_it_sent(served_http: ServerThread, body, said) -> None:  # type: ignore[no-untyped-def]
    error = post(served_http, body).json()["error"]
    assert error["param"] == "input" and error["message"].endswith(f"token ids; it is {said}"), error


def test_too_many_inputs_names_the_limit_and_the_client_settings_that_set_it(served_http: ServerThread) -> None:
    error = post(served_http, {"input": ["x"] * 21}).json()["error"]
    assert error["message"] == (
        "'input' holds 21 items, more than 20; send at most 20 a request "
        "(LangChain's chunk_size, LlamaIndex's embed_batch_size)"
    )


@pytest.fixture
def in_parts(tiny_artifacts: Path) -> Iterator[ServerThread]:
    """A server whose pipeline takes 4 inputs a request, and /v1/embeddings up to 20."""
    server = ServerThread(server_config(tiny_artifacts, max_client_batch_size=4, http_max_inputs=20))
    yield server
    server.stop()


PART_TEXTS = [f"text {i} about {'rivers and the quiet lungs of a cat ' * (i % 3)}".strip() for i in range(11)]


def test_a_request_over_the_pipelines_limit_is_embedded_in_parts_in_order(in_parts: ServerThread) -> None:
    """11 inputs where the pipeline takes 4: three requests of 4, 4 and 3, one after another, each input's
    embedding the one it gets alone; texts and token ids alike."""
    gate = GatedBackend(in_parts.server)
    gate.release()
    answer = post(in_parts, {"input": PART_TEXTS, "encoding_format": "float"}, token="")
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert [d["index"] for d in body["data"]] == list(range(11))
    got = np.array([d["embedding"] for d in body["data"]])
    alone = np.array([post(in_parts, {"input": t}, token="").json()["data"][0]["embedding"] for t in PART_TEXTS])
    np.testing.assert_allclose(got, alone, atol=1e-5)
    del gate.batch_sizes[:]
    assert post(in_parts, {"input": ["a river"] * 11}, token="").status_code == 200
    assert gate.batch_sizes == [4, 4, 3]  # one part in the queue at a time: all 11 alike would fit one batch
    rows = post(in_parts, {"inputs": PART_TEXTS[:4]}, token="", path="/tokenize").json()
    ids = [[token["id"] for token in row] for row in rows] * 3  # 12 rows of token ids: three parts of 4
    by_ids = post(in_parts, {"input": ids, "encoding_format": "float"}, token="").json()
    np.testing.assert_allclose(np.array([d["embedding"] for d in by_ids["data"]]), np.tile(got[:4], (3, 1)), atol=1e-5)
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 11 * 2


def test_a_request_in_parts_holds_its_bodys_place_until_its_last_part_is_answered(in_parts: ServerThread) -> None:
    admission = in_parts.server.admission
    gate = GatedBackend(in_parts.server)
    with httpx.Client(timeout=20) as http, ThreadPoolExecutor(1) as pool:
        pending = pool.submit(http.post, base_url(in_parts) + "/v1/embeddings", json={"input": PART_TEXTS})
        eventually(lambda: gate.held == 1, 10, "the first part at the backend")
        assert admission.calls == 1 and admission.held_bytes > 0  # held while its parts run
        gate.release()
        assert pending.result(20).status_code == 200
    assert admission.calls == 0 and admission.held_bytes == 0


def test_a_client_that_goes_away_stops_its_request_between_parts(in_parts: ServerThread) -> None:
    gate = GatedBackend(in_parts.server)
    body = json.dumps({"input": ["a river"] * 11}).encode()
    head = f"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}"
    with socket.create_connection(("127.0.0.1", in_parts.server.http_port)) as sock:
        sock.sendall(f"{head}\r\n\r\n".encode() + body)
        eventually(lambda: gate.held == 1, 10, "the first part at the backend")
    requests = in_parts.server.metrics.requests
    eventually(lambda: counter(requests, "POST /v1/embeddings", "499") == 1, 10, "the request answered 499")
    assert in_parts.server.admission.calls == 0  # at once, with its first part still at the backend
    gate.release()  # the first part finishes unseen; the next two never start
    assert post(in_parts, {"input": "after"}, token="").status_code == 200
    assert gate.batch_sizes == [4, 1]


def hold_event_loop(server: ServerThread, seconds: float) -> None:
    """Blocks the server's event loop for ``seconds``; returns once it is blocked."""
    held = threading.Event()

    def hold() -> None:
        held.set()
        time.sleep(seconds)

    server.loop.call_soon_threadsafe(hold)
    assert held.wait(10), "the server's event loop never ran the hold"


def test_a_client_that_goes_away_while_its_request_is_queued_has_nothing_computed(in_parts: ServerThread) -> None:
    """As a cancelled gRPC call: the inputs of a client that has disconnected are swept from the queue at once,
    never computed, counted as cancelled and answered (to nobody) 499."""
    server = in_parts.server
    gate = GatedBackend(server)
    with httpx.Client(timeout=20) as http, ThreadPoolExecutor(1) as pool:
        blocker = pool.submit(http.post, base_url(in_parts) + "/v1/embeddings", json={"input": "x"})
        eventually(lambda: gate.held == 1, 10, "the blocker's batch at the backend")
        doomed = []
        for i in range(3):
            body = json.dumps({"input": [f"{'long ' * 10} {i}"] * 2, "user": "u" * 100_000 * (i == 2)}).encode()
            head = f"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            sock = socket.create_connection(("127.0.0.1", server.http_port))
            doomed.append(sock)
            if i < 2:
                sock.sendall(head + body)
                continue
            # The last body's 100 KB arrive in one read while the request waits for them: past 64 KiB of body
            # uvicorn stops reading the socket, and a client that left would go unnoticed if reading stayed so.
            eventually(lambda: server.batcher.queued_items == 4, 10, "the first two requests queued")
            sock.sendall(head + body[:5])
            eventually(lambda: server.admission.calls == 1, 10, "the third request reading its body")
            hold_event_loop(in_parts, 0.5)  # while the rest arrives
            sock.sendall(body[5:])
        eventually(lambda: server.batcher.queued_items == 6, 10, "three requests of two inputs queued")
        for sock in doomed:
            sock.close()
        eventually(lambda: server.batcher.queued_items == 0, 10, "the queue swept when the clients went away")
        requests = server.metrics.requests
        eventually(lambda: counter(requests, "POST /v1/embeddings", "499") == 3, 10, "three requests answered 499")
        gate.release()
        assert blocker.result(20).status_code == 200
    assert post(in_parts, {"input": "after"}, token="").status_code == 200
    assert gate.batch_sizes == [1, 1]  # "x" and "after": no input of a client that left reached the backend
    assert counter(server.metrics.dropped_items, "cancelled") == 6
    assert server.admission.calls == 0


def test_a_bad_input_in_a_later_part_is_named_by_its_index_before_anything_is_computed(in_parts: ServerThread) -> None:
    gate = GatedBackend(in_parts.server)
    gate.release()
    texts = [*PART_TEXTS[:9], " ", PART_TEXTS[10]]
    error = post(in_parts, {"input": texts}, token="").json()["error"]
    assert (error["param"], error["message"]) == ("input", "input[9] is empty or only whitespace")
    assert gate.batch_sizes == []  # no part was computed
    too_long = [*PART_TEXTS[:9], "word " * 400, "x"]
    error = post(in_parts, {"input": too_long, "truncate": False}, token="").json()["error"]
    assert error["message"].startswith("input[9] has "), error


def test_a_field_of_the_wrong_kind_is_named_in_json_terms(served_http: ServerThread) -> None:
    error = post(served_http, {"input": "ok", "dimensions": "8"}).json()["error"]
    assert (error["message"], error["param"]) == ("'dimensions' must be an integer; it is a string", "dimensions")
    error = post(served_http, {"input": "ok", "normalize": 1}).json()["error"]
    assert error["message"] == "'normalize' must be a boolean; it is a number"


def test_a_faulty_input_is_named_as_openai_names_it(served_http: ServerThread) -> None:
    """input[i] and param "input" over HTTP, where gRPC's message says inputs[i] (its field)."""
    blank = post(served_http, {"input": ["ok", "  "]}).json()["error"]
    assert (blank["message"], blank["param"]) == ("input[1] is empty or only whitespace", "input")
    no_ids = post(served_http, {"input": [[5, 6], []]}).json()["error"]
    assert (no_ids["message"], no_ids["param"]) == ("input[1] is an empty list of token ids", "input")
    mixed = post(served_http, {"input": [5, "ok"]}).json()["error"]["message"]
    assert mixed.endswith("such lists; input[1] is a string, input[0] a number"), mixed
    for sent, said in (([{"text": "ok"}], "input[0] is an object"), ([[5, "6"]], "input[0] is a list holding a string"),
                       ([5, 6.5], "input[1] is a number that is not an integer")):  # fmt: skip
        message = post(served_http, {"input": sent}).json()["error"]["message"]
        assert message.endswith(f"such lists; {said}"), message
    long = post(served_http, {"input": ["ok", "ok " * 200], "truncate": False}).json()["error"]
    assert long["message"].startswith("input[1] has ") and "tokens, more than the limit of" in long["message"]
    # Token ids are the model's own, special tokens included: a row cut short would lose its closing one.
    for truncate in (True, False):
        ids = post(served_http, {"input": [[5] * 4, [5] * 200], "truncate": truncate}).json()["error"]
        assert (ids["message"], ids["param"]) == (
            "input[1] has 200 tokens, more than the limit of 32; token ids are never cut, truncate or not: "
            "send at most 32", "input")  # fmt: skip


def test_the_openai_client_raises_its_own_errors(served_http: ServerThread) -> None:
    with pytest.raises(openai.NotFoundError) as not_found:
        client(served_http).embeddings.create(input="x", model="no-such-model")
    assert not_found.value.body["code"] == "model_not_found"  # type: ignore[index]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{base_url(served_http)}/v1", api_key="wrong", max_retries=0).embeddings.create(
            input="x", model=""
        )
    response = post(served_http, {"input": "x"}, token="")
    assert response.status_code == 401 and response.json()["error"]["type"] == "authentication_error"


def test_every_answer_carries_a_request_id_that_the_openai_client_reads(served_http: ServerThread) -> None:
    openai_client = client(served_http)
    first, second = (openai_client.embeddings.create(input="x", model="") for _ in range(2))
    assert GENERATED_ID.fullmatch(first._request_id or "") and GENERATED_ID.fullmatch(second._request_id or "")
    assert first._request_id != second._request_id
    with pytest.raises(openai.NotFoundError) as not_found:  # an error names its request too
        openai_client.embeddings.create(input="x", model="no-such-model")
    assert GENERATED_ID.fullmatch(not_found.value.request_id or "")
    for answer in (
        httpx.get(base_url(served_http) + "/health"),
        httpx.get(base_url(served_http) + "/no/such/route"),
        post(served_http, {"input": "x"}, token=""),  # 401
    ):
        assert GENERATED_ID.fullmatch(answer.headers["x-request-id"]), answer.status_code


@pytest.mark.parametrize(
    "sent, echoed",
    [("gateway-42/7f3a:b", True), ("x" * 128, True), ("x" * 129, False), ("two words", False), ("", False)],
)
def test_a_callers_own_request_id_comes_back_when_it_is_a_sane_token(
    served_http: ServerThread, sent: str, echoed: bool
) -> None:
    headers = {"Authorization": f"Bearer {TOKEN}", "X-Request-Id": sent}
    answer = httpx.post(base_url(served_http) + "/v1/embeddings", json={"input": "x"}, headers=headers, timeout=20)
    assert answer.status_code == 200
    got = answer.headers["x-request-id"]
    assert got == sent if echoed else GENERATED_ID.fullmatch(got)
    jsonschema.validate(got, SCHEMAS["components"]["headers"]["RequestId"]["schema"])  # as /openapi.json says


def test_a_500_is_logged_with_the_request_id_its_caller_was_given(
    tiny_artifacts: Path, caplog: pytest.LogCaptureFixture
) -> None:
    server = ServerThread(server_config(tiny_artifacts))

    def fails(rows):  # type: ignore[no-untyped-def]
        raise RuntimeError("injected fault")

    server.server.batcher.swap_backend(fails)
    try:
        with caplog.at_level(logging.WARNING, logger="server.api.http.app"):
            answer = httpx.post(base_url(server) + "/v1/embeddings", json={"input": "unlucky"}, timeout=20)
        assert answer.status_code == 500 and answer.json()["error"]["type"] == "server_error"
        request_id = answer.headers["x-request-id"]
        assert any(request_id in r.getMessage() and "500" in r.getMessage() for r in caplog.records), caplog.text
    finally:
        server.stop()


def test_a_body_larger_than_the_limit_is_refused_before_it_is_read(served_http: ServerThread) -> None:
    limit = served_http.server.config.max_message_bytes
    with socket.create_connection(("127.0.0.1", served_http.server.http_port), timeout=10) as sock:
        head = (
            f"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {limit + 1}\r\n\r\n"
        )
        sock.sendall(head.encode())  # and not one byte of the body
        answer = read_response(sock)
    assert answer.startswith("HTTP/1.1 413"), answer
    assert '"code":"request_too_large"' in answer


def test_a_chunked_body_is_served_and_cut_off_past_the_limit_with_413(
    served_http: ServerThread, tiny_artifacts: Path
) -> None:
    """Transfer-Encoding: chunked (no Content-Length, as streaming clients and some proxies send it): admitted
    as the largest body, read, and answered like the same body with its length."""
    pieces = [b'{"input": ["a riv', b'er", "a dog"], "encoding_', b'format": "float"}']
    headers = {"Authorization": f"Bearer {TOKEN}"}
    chunked = httpx.post(base_url(served_http) + "/v1/embeddings", content=iter(pieces), headers=headers, timeout=20)
    sent = chunked.request.headers
    assert sent.get("transfer-encoding") == "chunked" and "content-length" not in sent
    assert chunked.status_code == 200, chunked.text
    whole = post(served_http, b"".join(pieces))
    assert chunked.json()["data"] == whole.json()["data"] and len(whole.json()["data"]) == 2

    server = ServerThread(server_config(tiny_artifacts, max_message_bytes=2000))
    try:
        with socket.create_connection(("127.0.0.1", server.server.http_port), timeout=10) as sock:
            sock.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
            for _ in range(3):  # 3 x 1,000 bytes against a 2,000-byte limit, no end chunk
                sock.sendall(b"3e8\r\n" + b" " * 1000 + b"\r\n")
            answer = read_response(sock)
        assert answer.startswith("HTTP/1.1 413"), answer
        assert '"code":"request_too_large"' in answer and "more than 2000 bytes" in answer
        assert server.server.admission.held_bytes == 0  # what the body held is given back
    finally:
        server.stop()


def test_a_compressed_body_is_refused_unread_with_415(served_http: ServerThread) -> None:
    """Inflating a gzip body would take memory its admitted size does not count: refused with a message
    saying what to send, never parsed as if it were JSON."""
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Encoding": "gzip"}
    body = gzip.compress(json.dumps({"input": "a river"}).encode())
    answer = httpx.post(base_url(served_http) + "/v1/embeddings", content=body, headers=headers, timeout=20)
    assert answer.status_code == 415, answer.text
    conforms(answer.json(), "Error")
    error = answer.json()["error"]
    assert error["code"] == "unsupported_content_encoding" and "send it uncompressed" in error["message"]
    assert served_http.server.admission.held_bytes == 0
    plain = {"Authorization": f"Bearer {TOKEN}", "Content-Encoding": "identity"}  # the same as none
    answer = httpx.post(base_url(served_http) + "/v1/embeddings", json={"input": "a river"}, headers=plain, timeout=20)
    assert answer.status_code == 200


def test_a_slow_body_times_out_with_400(tiny_artifacts: Path) -> None:
    server = ServerThread(server_config(tiny_artifacts, http_body_timeout_seconds=0.5))
    try:
        with socket.create_connection(("127.0.0.1", server.server.http_port), timeout=10) as sock:
            head = 'POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"input":'
            sock.sendall(head.encode())  # then nothing more
            started = time.monotonic()
            answer = read_response(sock)
        assert answer.startswith("HTTP/1.1 400") and "did not arrive within 0.5 s" in answer, answer
        assert time.monotonic() - started < 5
        assert server.server.admission.calls == 0 and server.server.admission.held_bytes == 0  # all released
    finally:
        server.stop()


def test_the_client_is_the_connection_whatever_x_forwarded_for_says(served_http: ServerThread) -> None:
    """Admission and fair queueing key on the client: a header must not let a sender pose as another."""
    api = served_http.server.http_api
    route = api._routes[("POST", "/v1/embeddings")]
    clients: list[str] = []

    async def recording(scope, receive, client):  # type: ignore[no-untyped-def]
        clients.append(client)
        return await route(scope, receive, client)

    api._routes[("POST", "/v1/embeddings")] = recording
    try:
        headers = {"Authorization": f"Bearer {TOKEN}", "X-Forwarded-For": "10.9.9.9"}
        response = httpx.post(base_url(served_http) + "/v1/embeddings", json={"input": "x"}, headers=headers)
    finally:
        api._routes[("POST", "/v1/embeddings")] = route
    assert response.status_code == 200
    assert len(clients) == 1 and clients[0].startswith("http:127.0.0.1:"), clients


def test_the_gauges_show_what_a_request_holds_while_its_body_arrives(served_http: ServerThread) -> None:
    registry = served_http.server.metrics.registry

    def gauges() -> tuple[float | None, ...]:
        names = ("embed_requests_in_flight", "embed_request_calls", "embed_request_bytes")
        return tuple(registry.get_sample_value(name) for name in names)

    body = json.dumps({"input": "held while it arrives"}).encode()
    assert gauges() == (0, 0, 0)
    with socket.create_connection(("127.0.0.1", served_http.server.http_port), timeout=10) as sock:
        head = b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n" % TOKEN.encode()
        sock.sendall(head + b"Content-Length: %d\r\n\r\n" % len(body) + body[:5])
        eventually(lambda: gauges() == (1, 1, len(body)), what=f"one call holding {len(body)} bytes: {gauges()}")
        sock.sendall(body[5:])
        assert read_response(sock).startswith("HTTP/1.1 200")
    eventually(lambda: gauges() == (0, 0, 0), what=f"everything released: {gauges()}")


def test_a_body_trickling_in_times_out_as_a_whole(tiny_artifacts: Path) -> None:
    """The body timeout bounds the whole body: a byte every 0.1 s never waits 0.5 s for one chunk."""
    server = ServerThread(server_config(tiny_artifacts, http_body_timeout_seconds=0.5))
    body = json.dumps({"input": "a body sent one byte at a time"}).encode()
    try:
        with socket.create_connection(("127.0.0.1", server.server.http_port), timeout=10) as sock:
            sock.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body))
            started = time.monotonic()
            for byte in body:  # until the server answers
                if select.select([sock], [], [], 0.1)[0]:
                    break
                sock.sendall(bytes([byte]))
            answer = read_response(sock)
        assert answer.startswith("HTTP/1.1 400") and "did not arrive within 0.5 s" in answer, answer
        assert time.monotonic() - started < 0.1 * len(body) / 2  # long before the last byte would have gone
        assert server.server.admission.calls == 0 and server.server.admission.held_bytes == 0
    finally:
        server.stop()


def test_overload_is_429_naming_the_budget(served_http: ServerThread) -> None:
    admission = served_http.server.admission
    real = admission.max_calls
    admission.max_calls = 0  # every place taken
    try:
        response = post(served_http, {"input": "x"})
    finally:
        admission.max_calls = real
    assert response.status_code == 429
    assert "request bodies in progress full" in response.json()["error"]["message"]


def test_models_info_health_and_openapi(served_http: ServerThread, tiny_artifacts: Path) -> None:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    models = httpx.get(base_url(served_http) + "/v1/models", headers=headers).json()
    conforms(models, "ModelList")
    assert [m["id"] for m in models["data"]] == list(served_http.server.state.models)
    exported = int((tiny_artifacts / "manifest.json").stat().st_mtime)  # OpenAI's `created`: when it was exported
    assert [m["created"] for m in models["data"]] == [exported]
    listed = client(served_http).models.list()
    assert [m.id for m in listed.data] == list(served_http.server.state.models)
    info = httpx.get(base_url(served_http) + "/info", headers=headers).json()
    conforms(info, "Info")
    assert info["max_request_calls"] == served_http.server.admission.max_calls
    assert httpx.get(base_url(served_http) + "/health").json() == {"status": "ok"}
    assert httpx.get(base_url(served_http) + "/ready").status_code == 200
    assert httpx.get(base_url(served_http) + "/openapi.json").json() == SCHEMAS
    nowhere = httpx.get(base_url(served_http) + "/nowhere")
    assert nowhere.status_code == 404 and nowhere.json()["error"]["message"] == "no route GET /nowhere"
    wrong_method = httpx.get(base_url(served_http) + "/v1/embeddings")
    assert wrong_method.status_code == 405 and wrong_method.headers["allow"] == "POST"
    assert wrong_method.json()["error"]["message"] == "/v1/embeddings takes POST, not GET"
    posted_health = httpx.post(base_url(served_http) + "/health")
    assert posted_health.status_code == 405 and posted_health.headers["allow"] == "GET, HEAD"
    # A base URL without /v1, or a trailing slash: the 404 says where the route is.
    for slip in ("/embeddings", "/v1/embeddings/", "/embeddings/"):
        answer = post(served_http, {"input": "x"}, path=slip)
        assert answer.status_code == 404, slip
        assert "did you mean POST /v1/embeddings?" in answer.json()["error"]["message"], slip
    slipped = httpx.get(base_url(served_http) + "/models/wordnet-encoder", headers={"Authorization": f"Bearer {TOKEN}"})
    assert slipped.status_code == 404
    assert "did you mean GET /v1/models/wordnet-encoder?" in slipped.json()["error"]["message"]


def test_a_model_is_retrieved_by_any_name_it_is_served_under(tiny_artifacts: Path, tiny_bert_artifacts: Path) -> None:
    """OpenAI's `models.retrieve`: a model named by its manifest id (the client sends the slash of
    "test/tiny-bert" as %2F; curl would send it as it is) or by the id's last part, answered with its
    served name; an unknown name is 404 model_not_found; the metrics keep one series for the route."""
    server = ServerThread(server_config(tiny_artifacts, model=(str(tiny_artifacts), str(tiny_bert_artifacts))))
    try:
        openai_client = openai.OpenAI(base_url=f"{base_url(server)}/v1", api_key="unused", max_retries=0)
        assert list(server.server.state.models) == ["wordnet-encoder", "test/tiny-bert"]
        for name, served in (("wordnet-encoder",) * 2, ("test/tiny-bert",) * 2, ("tiny-bert", "test/tiny-bert")):
            model = openai_client.models.retrieve(name)
            assert (model.id, model.object, model.owned_by) == (served, "model", "embedding-service"), name
            raw = httpx.get(f"{base_url(server)}/v1/models/{name}")
            assert raw.status_code == 200 and raw.json()["id"] == served, name
            conforms(raw.json(), "Model")
        with pytest.raises(openai.NotFoundError) as refused:
            openai_client.models.retrieve("no-such-model")
        assert refused.value.body["code"] == "model_not_found"  # type: ignore[index]
        assert "'no-such-model'" in refused.value.body["message"]  # type: ignore[index]
        posted = httpx.post(f"{base_url(server)}/v1/models/wordnet-encoder")
        assert posted.status_code == 405 and posted.headers["allow"] == "GET, HEAD"
        requests = server.server.metrics.requests
        server.settled()
        assert counter(requests, "GET /v1/models/{model}", "200") == 6
        assert counter(requests, "GET /v1/models/{model}", "404") == 1
        assert not any("tiny-bert" in s.labels["method"] for f in requests.collect() for s in f.samples)
    finally:
        server.stop()


def test_curl_posts_embeddings(served_http: ServerThread) -> None:
    headers = ["-H", f"Authorization: Bearer {TOKEN}", "-H", "Content-Type: application/json"]
    data = ["-d", '{"input": "the cat sat on the mat", "model": ""}']
    done = subprocess.run(
        ["curl", "-sS", *headers, *data, f"{base_url(served_http)}/v1/embeddings"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    body = json.loads(done.stdout)
    conforms(body, "EmbeddingResponse")
    np.testing.assert_allclose(body["data"][0]["embedding"], grpc_embeddings(served_http, TEXTS[0])[0], atol=1e-5)


def test_readiness_is_503_until_loaded_and_from_the_drain(tiny_artifacts: Path) -> None:
    server = ServerThread(server_config(tiny_artifacts, drain_delay_seconds=0.5), load=False)
    url = f"http://127.0.0.1:{server.server.http_port}"
    try:
        assert httpx.get(url + "/health").status_code == 200
        assert httpx.get(url + "/ready").json() == {"status": "not ready"}
        response = httpx.post(url + "/v1/embeddings", json={"input": "x"})
        assert response.status_code == 503 and response.json()["error"]["type"] == "service_unavailable"
        server.call(server.server.load())
        assert httpx.get(url + "/ready").status_code == 200
        stopping = asyncio.run_coroutine_threadsafe(server.server.stop(1.0), server.loop)
        deadline = time.monotonic() + 5
        while httpx.get(url + "/ready").status_code != 503:
            assert time.monotonic() < deadline, "readiness never turned 503 on drain"
            time.sleep(0.02)
        assert httpx.get(url + "/ready").json() == {"status": "draining"}
        assert httpx.post(url + "/v1/embeddings", json={"input": "x"}).status_code == 200  # still served
        stopping.result(30)
    finally:
        server.loop.call_soon_threadsafe(server.loop.stop)


def test_http_requests_are_counted_with_their_protocol(served_http: ServerThread) -> None:
    name = served_http.server.default.name
    labels = {"protocol": "http", "method": "POST /v1/embeddings", "code": "200", "model": name}
    registry = served_http.server.metrics.registry
    timed = {k: v for k, v in labels.items() if k != "code"}
    before = registry.get_sample_value("embed_requests_total", labels) or 0.0
    timed_before = registry.get_sample_value("embed_request_duration_seconds_count", timed) or 0.0
    post(served_http, {"input": "counted"})
    post(served_http, {"input": "refused", "dimensions": 0})
    assert registry.get_sample_value("embed_requests_total", labels) == before + 1
    refused = {**labels, "code": "400"}
    assert (registry.get_sample_value("embed_requests_total", refused) or 0.0) >= 1
    assert registry.get_sample_value("embed_request_duration_seconds_count", timed) == timed_before + 2


def test_an_http_refusal_is_counted_against_the_model_it_named(served_http: ServerThread) -> None:
    """As over gRPC: the dashboard's rejections, filtered by model, show both protocols' refusals."""
    name = served_http.server.default.name
    registry = served_http.server.metrics.registry

    def refused(model: str) -> float:
        return registry.get_sample_value("embed_rejections_total", {"reason": "invalid", "model": model}) or 0.0

    before, unnamed = refused(name), refused("")
    assert post(served_http, {"input": "x", "model": name, "dimensions": 0}).status_code == 400
    assert post(served_http, {"input": "x", "model": "no-such-model"}).status_code == 404
    assert refused(name) == before + 1
    assert refused("") == unnamed + 1  # no model was resolved


def test_tokenize_shows_each_token_where_it_came_from_and_what_embeddings_count(served_http: ServerThread) -> None:
    texts = ["Rivers carry water", "a lung " * 40]  # the second is longer than the model's 32 tokens
    response = post(served_http, {"inputs": texts}, path="/tokenize")
    assert response.status_code == 200
    tokens = response.json()
    conforms(tokens, "Tokens")
    assert len(tokens) == 2
    first = tokens[0]
    assert first[0]["special"] and first[-1]["special"] and first[0]["start"] is None  # [CLS] ... [SEP]
    for t in first[1:-1]:  # every other token points at the characters it was read from
        assert not t["special"] and texts[0][t["start"] : t["stop"]].lower() == t["text"].removeprefix("##")
    assert len(tokens[1]) > 32  # untruncated: it shows how much truncation would cut
    embedded = post(served_http, {"input": texts[0]}).json()
    assert embedded["usage"]["prompt_tokens"] == len(first)
    ids = [t["id"] for t in first]  # the ids are the model's own: embedding them equals embedding the text
    by_ids = post(served_http, {"input": ids}).json()["data"][0]["embedding"]
    assert np.allclose(by_ids, embedded["data"][0]["embedding"], atol=1e-6)
    bare = post(served_http, {"inputs": texts[0], "add_special_tokens": False}, path="/tokenize").json()
    assert [t["id"] for t in bare[0]] == ids[1:-1]


@pytest.mark.parametrize(
    ("body", "param"),
    [({}, "inputs"), ({"inputs": []}, "inputs"), ({"inputs": [1, 2]}, "inputs"), ({"inputs": ["ok", " "]}, "inputs"),
     ({"inputs": "ok", "add_special_tokens": "yes"}, "add_special_tokens")],
)  # fmt: skip
def test_tokenize_refuses_bad_requests_with_openai_errors(served_http: ServerThread, body, param) -> None:  # type: ignore[no-untyped-def]
    response = post(served_http, body, path="/tokenize")
    assert response.status_code == 400
    conforms(response.json(), "Error")
    assert response.json()["error"]["param"] == param
    assert post(served_http, {"inputs": "ok", "model": "nope"}, path="/tokenize").status_code == 404
    assert post(served_http, {"inputs": "ok"}, token="", path="/tokenize").status_code == 401


def test_browsers_on_allowed_origins_get_cors_headers_and_others_none(
    served_http: ServerThread, tiny_artifacts: Path
) -> None:
    app = "https://app.example"
    server = ServerThread(server_config(tiny_artifacts, http_cors_origins=f"{app}, http://localhost:3000"))
    try:
        url = base_url(server)
        asked = {"Origin": app, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type, x-stainless-lang"}  # fmt: skip
        preflight = httpx.options(url + "/v1/embeddings", headers=asked)
        assert preflight.status_code == 204, preflight.text
        assert preflight.headers["access-control-allow-origin"] == app
        assert "POST" in preflight.headers["access-control-allow-methods"]
        assert preflight.headers["access-control-allow-headers"] == asked["Access-Control-Request-Headers"]
        answer = httpx.post(url + "/v1/embeddings", json={"input": "a river", "dimensions": 8}, headers={"Origin": app})
        assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == app
        assert answer.headers["vary"] == "origin"
        # A page's script reads a response header only when the server exposes it.
        assert answer.headers["x-dimensions-trained"] == "false"
        assert answer.headers["access-control-expose-headers"] == "x-dimensions-trained, x-request-id"
        error = httpx.post(url + "/v1/embeddings", json={"input": []}, headers={"Origin": app})
        assert error.status_code == 400 and error.headers["access-control-allow-origin"] == app  # readable too

        other = {**asked, "Origin": "https://evil.example"}
        refused = httpx.options(url + "/v1/embeddings", headers=other)
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "origin_not_allowed"
        assert "access-control-allow-origin" not in refused.headers
        served = httpx.post(
            url + "/v1/embeddings", json={"input": "a river"}, headers={"Origin": "https://evil.example"}
        )
        assert served.status_code == 200 and "access-control-allow-origin" not in served.headers  # the browser hides it
    finally:
        server.stop()
    # Off by default: no origin gets the header, and a preflight is an unknown method.
    plain = post(served_http, {"input": "a river"})
    closed = httpx.post(base_url(served_http) + "/v1/embeddings", content=plain.request.content,
                        headers={"Origin": app, "Authorization": f"Bearer {TOKEN}"})  # fmt: skip
    assert closed.status_code == 200 and "access-control-allow-origin" not in closed.headers
    assert httpx.options(base_url(served_http) + "/v1/embeddings", headers={"Origin": app}).status_code == 405


def test_cors_origins_must_be_origins() -> None:
    from server.config import ServerConfig

    assert ServerConfig(http_cors_origins=" https://a.example/ , *").cors_origins() == ("https://a.example", "*")
    with pytest.raises(ValueError, match=r"'app\.example' is not \* nor an origin"):
        ServerConfig(http_cors_origins="app.example")


def test_null_optional_fields_mean_not_given(served_http: ServerThread) -> None:
    """Clients that serialise every field send null for the ones not set: the defaults apply."""
    nulls = {"model": None, "encoding_format": None, "dimensions": None, "user": None, "normalize": None}
    request_body = {"input": "a river", **nulls, "truncate": None}
    conforms(request_body, "EmbeddingRequest")  # the OpenAPI description says so too
    answer = post(served_http, request_body)
    assert answer.status_code == 200, answer.text
    assert answer.json()["data"] == post(served_http, {"input": "a river"}).json()["data"]
    assert post(served_http, {"input": None}).json()["error"]["param"] == "input"  # input itself is required
