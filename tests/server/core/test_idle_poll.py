"""server/core/idle_poll.py: the poll that keeps the event loop awake for a lone client's next request, on a fake
clock; and the event loops of server/loops.py."""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest

from embedding.v1 import embedding_pb2
from server.core.idle_poll import IdlePoll
from server.loops import EVENT_LOOPS, run
from tests.conftest import ServerThread, eventually, server_config
from tests.fake_clock import FakeClock, turns


def on_each_loop(test: Callable[[], Coroutine[Any, Any, None]]) -> None:
    for name in EVENT_LOOPS:
        run(test(), name)


async def polls_during(clock: FakeClock, turns_of_the_loop: int = 50) -> int:
    """How many times the poll read the clock while the loop turned this often: once a turn while it polls."""
    before = clock.reads
    await turns(turns_of_the_loop)
    return clock.reads - before


def test_the_idle_poll_keeps_the_loop_turning_for_its_window_then_lets_it_sleep() -> None:
    async def test() -> None:
        clock = FakeClock()
        poll = IdlePoll(0.2, busy=lambda: False, clock=clock)
        poll.start()
        assert poll.polling
        assert await polls_during(clock) >= 40, "the loop did not poll on every turn"
        await clock.advance(0.19)
        assert poll.polling, "the poll ended before its window"
        await clock.advance(0.02)
        assert not poll.polling, "the poll went on after its window"
        assert await polls_during(clock) == 0, "the loop went on polling after its window"

    on_each_loop(test)


def test_a_window_of_zero_never_polls() -> None:
    async def test() -> None:
        clock = FakeClock()
        poll = IdlePoll(0.0, busy=lambda: False, clock=clock)
        poll.start()
        assert not poll.polling
        assert await polls_during(clock) == 0

    on_each_loop(test)


def test_the_poll_neither_starts_nor_goes_on_while_a_request_is_in_progress() -> None:
    async def test() -> None:
        in_progress = True
        clock = FakeClock()
        poll = IdlePoll(10.0, busy=lambda: in_progress, clock=clock)
        poll.start()
        assert not poll.polling  # the loop has a request to finish: it will be awake when it is answered

        in_progress = False
        poll.start()
        assert poll.polling
        await turns()
        in_progress = True  # a request came: the loop has work, polling for more would only take its core
        await turns()
        assert not poll.polling, "the poll went on while a request was in progress"
        assert await polls_during(clock) == 0

    on_each_loop(test)


def test_a_second_answer_within_the_window_extends_it_with_one_poller() -> None:
    async def test() -> None:
        clock = FakeClock()
        poll = IdlePoll(0.15, busy=lambda: False, clock=clock)
        poll.start()
        first = asyncio.all_tasks()
        await clock.advance(0.1)
        poll.start()  # another lone request answered: the window runs from here
        assert asyncio.all_tasks() == first, "a second poller was started beside the first"
        await clock.advance(0.1)  # past the first window's end, within the second's
        assert poll.polling
        await clock.advance(0.06)
        assert not poll.polling

    on_each_loop(test)


def test_the_last_request_answered_over_either_protocol_starts_the_poll(tiny_artifacts: Path) -> None:
    server = ServerThread(server_config(tiny_artifacts, idle_poll_us=200))
    clock = FakeClock()
    poll = server.server.state.idle_poll
    poll.clock = clock  # the window ends when the test moves this clock, however slow the machine
    try:
        assert not poll.polling
        url = f"http://127.0.0.1:{server.server.http_port}/v1/embeddings"
        request = urllib.request.Request(
            url, data=b'{"input": "a lone text"}', headers={"content-type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=10) as answer:
            assert answer.status == 200
        assert poll.polling, "an HTTP answer left the loop to sleep at once"
        clock.jump(200e-6)
        eventually(lambda: not poll.polling, what="the poll ended after its window")

        server.stub().Embed(embedding_pb2.EmbedRequest(inputs=["a lone text"]), timeout=10)
        assert poll.polling, "a gRPC answer left the loop to sleep at once"
        clock.jump(200e-6)
        eventually(lambda: not poll.polling, what="the poll ended after its window")
    finally:
        server.stop()


def test_idle_poll_us_must_not_be_negative(tiny_artifacts: Path) -> None:
    with pytest.raises(ValueError, match="idle_poll_us"):
        server_config(tiny_artifacts, idle_poll_us=-1)
