"""server/loops.py: the idle poll that keeps the event loop awake for a lone client's next request."""

from __future__ import annotations

import asyncio
import time
import urllib.request
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest

from embedding.v1 import embedding_pb2
from server.loops import EVENT_LOOPS, IdlePoll, run
from tests.conftest import ServerThread, eventually, server_config


def on_each_loop(test: Callable[[], Coroutine[Any, Any, None]]) -> None:
    for name in EVENT_LOOPS:
        run(test(), name)


async def loop_cpu_seconds(seconds: float) -> float:
    """CPU time of the loop's thread while it waits ``seconds`` for nothing but the poll."""
    before = time.thread_time()
    await asyncio.sleep(seconds)
    return time.thread_time() - before


def test_the_idle_poll_keeps_the_loop_turning_for_its_window_then_lets_it_sleep() -> None:
    async def test() -> None:
        poll = IdlePoll(0.2, busy=lambda: False)
        poll.start()
        assert poll.polling
        polled = await loop_cpu_seconds(0.3)  # the window and after
        assert not poll.polling
        slept = await loop_cpu_seconds(0.3)
        # A loop asleep in epoll takes next to no CPU; one polling takes the core for the window (less whatever
        # the test machine's other work takes from it).
        assert polled > 0.06, f"the loop took {polled:.3f} s of CPU in a 0.2 s poll: it did not poll"
        assert slept < 0.03, f"the loop took {slept:.3f} s of CPU after its window: it went on polling"

    on_each_loop(test)


def test_a_window_of_zero_never_polls() -> None:
    async def test() -> None:
        poll = IdlePoll(0.0, busy=lambda: False)
        poll.start()
        assert not poll.polling
        assert await loop_cpu_seconds(0.2) < 0.03

    on_each_loop(test)


def test_the_poll_neither_starts_nor_goes_on_while_a_request_is_in_progress() -> None:
    async def test() -> None:
        in_progress = True
        poll = IdlePoll(10.0, busy=lambda: in_progress)
        poll.start()
        assert not poll.polling  # the loop has a request to finish: it will be awake when it is answered

        in_progress = False
        poll.start()
        assert poll.polling
        await asyncio.sleep(0.01)
        in_progress = True  # a request came: the loop has work, polling for more would only take its core
        started = time.perf_counter()
        while poll.polling and time.perf_counter() - started < 5:
            await asyncio.sleep(0.001)
        assert not poll.polling, "the poll went on while a request was in progress"

    on_each_loop(test)


def test_a_second_answer_within_the_window_extends_it_with_one_poller() -> None:
    async def test() -> None:
        poll = IdlePoll(0.15, busy=lambda: False)
        poll.start()
        first = asyncio.all_tasks()
        await asyncio.sleep(0.1)
        poll.start()  # another lone request answered: the window runs from here
        assert asyncio.all_tasks() == first, "a second poller was started beside the first"
        await asyncio.sleep(0.1)  # past the first window's end, within the second's
        assert poll.polling
        await asyncio.sleep(0.15)
        assert not poll.polling

    on_each_loop(test)


def wait_for_the_poll_to_end(server: ServerThread) -> None:
    eventually(lambda: not server.server.state.idle_poll.polling, what="the poll ended after its window")


def test_the_last_request_answered_over_either_protocol_starts_the_poll(tiny_artifacts: Path) -> None:
    server = ServerThread(server_config(tiny_artifacts, idle_poll_us=1_500_000))
    try:
        assert not server.server.state.idle_poll.polling
        url = f"http://127.0.0.1:{server.server.http_port}/v1/embeddings"
        request = urllib.request.Request(
            url, data=b'{"input": "a lone text"}', headers={"content-type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=10) as answer:
            assert answer.status == 200
        assert server.server.state.idle_poll.polling, "an HTTP answer left the loop to sleep at once"
        wait_for_the_poll_to_end(server)

        server.stub().Embed(embedding_pb2.EmbedRequest(inputs=["a lone text"]), timeout=10)
        assert server.server.state.idle_poll.polling, "a gRPC answer left the loop to sleep at once"
        wait_for_the_poll_to_end(server)
    finally:
        server.stop()


def test_idle_poll_us_must_not_be_negative(tiny_artifacts: Path) -> None:
    with pytest.raises(ValueError, match="idle_poll_us"):
        server_config(tiny_artifacts, idle_poll_us=-1)
