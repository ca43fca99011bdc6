"""SIGTERM under load, in a real `python -m server` process: nothing that reached the server is refused."""

from __future__ import annotations

import asyncio
import math
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import grpc
import httpx

from embedding.v1 import embedding_pb2, embedding_pb2_grpc
from loadtest.run import free_port, wait_serving
from tests.conftest import LOG_LINE

ROOT = Path(__file__).resolve().parents[2]
CLIENTS = 48
DRAIN_DELAY = 1.0
STEADY = 3  # answers per client before the signal: requests are queued, running and arriving


async def steady_load(answers: list[int]) -> None:
    """Until every client has had STEADY answers (fails, never passes silently, after 30 s)."""
    deadline = time.monotonic() + 30
    while min(answers) < STEADY:
        assert time.monotonic() < deadline, f"no steady load within 30 s: answers per client {answers}"
        await asyncio.sleep(0.01)


def test_sigterm_serves_every_request_sent_before_it_then_refuses_at_the_transport(tiny_artifacts: Path) -> None:
    port = free_port()
    target = f"127.0.0.1:{port}"
    env = {**os.environ, "EMBED_PORT": str(port), "EMBED_METRICS_PORT": "0", "EMBED_HOST": "127.0.0.1"}
    env["EMBED_HTTP_PORT"] = "-1"  # over gRPC only; the default HTTP port is not ours to take in a test run
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "server",
            "--model-dir",
            str(tiny_artifacts),
            "--drain-delay-seconds",
            str(DRAIN_DELAY),
            "--grace-seconds",
            "20",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    texts = [f"sentence number {i} about the quiet river and the lungs" for i in range(4)]
    outcomes: list[tuple[float, str]] = []  # (send time, outcome) of every request

    async def closed_loop_clients() -> float:
        channel = grpc.aio.insecure_channel(target)
        stub = embedding_pb2_grpc.EmbedderStub(channel)

        answers = [0] * CLIENTS

        async def client(i: int) -> None:
            # Like a real client: send again as soon as answered; on a refusal, go elsewhere (stop here).
            while True:
                sent = time.monotonic()
                try:
                    response = await stub.Embed(embedding_pb2.EmbedRequest(inputs=texts, truncate=True), timeout=30)
                    outcome = "OK" if len(response.embeddings) == len(texts) else "WRONG"
                except grpc.aio.AioRpcError as e:
                    outcome = e.code().name
                outcomes.append((sent, outcome))
                answers[i] += 1
                if outcome != "OK":
                    return

        tasks = [asyncio.create_task(client(i)) for i in range(CLIENTS)]
        await steady_load(answers)
        signalled = time.monotonic()
        process.send_signal(signal.SIGTERM)
        _, pending = await asyncio.wait(tasks, timeout=40)
        assert not pending, f"{len(pending)} clients still waiting 40 s after SIGTERM"
        await channel.close()
        return signalled

    try:
        wait_serving(target, process=process)
        signalled = asyncio.run(closed_loop_clients())
        code = process.wait(30)
        log = process.stdout.read() if process.stdout else ""
    finally:
        if process.poll() is None:
            process.kill()
    before = Counter(outcome for sent, outcome in outcomes if sent < signalled)
    after = Counter(outcome for sent, outcome in outcomes if sent >= signalled)
    served_late = [sent - signalled for sent, outcome in outcomes if sent >= signalled and outcome == "OK"]
    print(
        f"\nshutdown: {CLIENTS} closed-loop clients; sent before SIGTERM {dict(before)}, after {dict(after)}; "
        f"served up to {max(served_late, default=0):.2f} s after the signal; exit {code}"
    )
    assert code == 0, log
    # The promise: every request sent before the signal is answered, none refused.
    assert sum(before.values()) > CLIENTS and set(before) == {"OK"}, before
    # The drain delay really serves (health is NOT_SERVING, handlers do not refuse)...
    assert served_late and max(served_late) > 0.5 * DRAIN_DELAY, served_late
    # ...then gRPC's stop refuses at the transport: every client ends UNAVAILABLE, or CANCELLED when its call
    # raced the stop (gRPC core cancels calls received but not yet dispatched); never an error of ours, and
    # only at the end of the drain delay.
    assert after["UNAVAILABLE"] > 0 and set(after) <= {"OK", "UNAVAILABLE", "CANCELLED"}, after
    refused_at = [sent - signalled for sent, outcome in outcomes if outcome != "OK"]
    assert min(refused_at) > 0.5 * DRAIN_DELAY, sorted(refused_at)[:5]
    ok = before["OK"] + after["OK"]
    assert f"stopped: {ok} embedding requests (gRPC and HTTP) answered OK, 0 calls cut off" in log, log[-2000:]


def test_sigterm_under_http_load_serves_every_request_sent_before_it(tiny_artifacts: Path) -> None:
    port, http_port = free_port(), free_port()
    env = {**os.environ, "EMBED_PORT": str(port), "EMBED_METRICS_PORT": "0", "EMBED_HOST": "127.0.0.1"}
    env.update(EMBED_HTTP_PORT=str(http_port), EMBED_HTTP_HOST="127.0.0.1")
    process = subprocess.Popen(
        [sys.executable, "-m", "server", "--model-dir", str(tiny_artifacts), "--drain-delay-seconds", str(DRAIN_DELAY)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    body = {"input": [f"sentence number {i} about the quiet river and the lungs" for i in range(4)]}
    # (written, answered, outcome) of every request; written: when its last byte left this process (httpcore's
    # trace), so a starved client that decided to send before the signal but wrote after it counts as after.
    outcomes: list[tuple[float, float, str]] = []

    async def closed_loop_clients() -> float:
        # One kept-alive connection per client: no new connections (and ports in TIME_WAIT) per request.
        limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=CLIENTS)
        answers = [0] * CLIENTS
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{http_port}", timeout=30, limits=limits) as http:

            async def client(i: int) -> None:
                while True:
                    written = [math.inf]

                    async def trace(event: str, _: dict[str, object], written: list[float] = written) -> None:
                        if event == "http11.send_request_body.complete":
                            written[0] = time.monotonic()

                    try:
                        response = await http.post("/v1/embeddings", json=body, extensions={"trace": trace})
                        ok = response.status_code == 200 and len(response.json()["data"]) == 4
                        outcome = "OK" if ok else str(response.status_code)
                    except httpx.ConnectError:  # never reached the server: no connection was made
                        outcome = "not connected"
                    except httpx.TransportError as e:  # the connection closed at the end of the drain delay
                        outcome = type(e).__name__
                    outcomes.append((written[0], time.monotonic(), outcome))
                    answers[i] += 1
                    if outcome != "OK":
                        return

            tasks = [asyncio.create_task(client(i)) for i in range(CLIENTS)]
            await steady_load(answers)
            signalled = time.monotonic()
            process.send_signal(signal.SIGTERM)
            _, pending = await asyncio.wait(tasks, timeout=40)
            assert not pending, f"{len(pending)} HTTP clients still waiting 40 s after SIGTERM"
            return signalled

    try:
        wait_serving(f"127.0.0.1:{port}", process=process)
        with socket.create_connection(("127.0.0.1", http_port), timeout=10) as garbage:  # uvicorn logs a warning
            garbage.sendall(b"NOT HTTP\r\n\r\n")
            assert garbage.recv(12) == b"HTTP/1.1 400"
        signalled = asyncio.run(closed_loop_clients())
        code = process.wait(30)
        log = process.stdout.read() if process.stdout else ""
    finally:
        if process.poll() is None:
            process.kill()
    before = Counter(outcome for written, _, outcome in outcomes if written < signalled)
    after = Counter(outcome for written, _, outcome in outcomes if written >= signalled)
    print(f"\nHTTP shutdown: written before SIGTERM {dict(before)}, after (or never) {dict(after)}; exit {code}")
    assert code == 0, log
    assert sum(before.values()) > CLIENTS and set(before) == {"OK"}, before  # nothing written before it failed
    assert after["OK"] > 0  # the drain delay serves
    # No refusal before the drain delay: timed by when the client saw it, never earlier than the server acted.
    refused_at = [answered - signalled for _, answered, outcome in outcomes if outcome != "OK"]
    assert min(refused_at) > 0.5 * DRAIN_DELAY, sorted(refused_at)[:5]
    ok = before["OK"] + after["OK"]
    assert f"stopped: {ok} embedding requests (gRPC and HTTP) answered OK, 0 calls cut off" in log, log[-2000:]
    # One format for every line, uvicorn's included (its own handler writes no time), and no traceback.
    assert "WARNING uvicorn.error: Invalid HTTP request received." in log, log[-2000:]
    assert all(LOG_LINE.match(line) for line in log.splitlines()), log[-2000:]


def test_a_sigterm_while_the_server_binds_its_ports_stops_it_cleanly(tiny_artifacts: Path) -> None:
    """A SIGTERM that arrives while the server is still starting stops it with exit 0 and its closing log line,
    as one that arrives later does, instead of meeting the signal's default action."""
    script = f"""
import os, signal
from server import app
listen = app.EmbeddingServer._listen
async def signalled_while_listening(self):
    os.kill(os.getpid(), signal.SIGTERM)
    await listen(self)
app.EmbeddingServer._listen = signalled_while_listening
app.main(["--model-dir", {str(tiny_artifacts)!r}, "--host", "127.0.0.1", "--port", "0", "--http-port", "-1",
          "--metrics-port", "-1", "--log-level", "INFO"])
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "stopped: 0 embedding requests" in done.stderr, done.stderr[-2000:]
