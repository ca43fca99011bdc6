"""A clock that moves only when a test moves it, for the parts that wait on time (server/core/clock.py)."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from server.core.clock import Clock


@dataclass(order=True)
class FakeTimer:
    when: float
    order: int
    callback: Callable[..., Any] = field(compare=False)
    args: tuple[Any, ...] = field(compare=False)
    cancelled: bool = field(default=False, compare=False)

    def cancel(self) -> None:
        self.cancelled = True


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


async def turns(n: int = 20) -> None:
    """Lets the event loop run what is ready, without letting any real time matter."""
    for _ in range(n):
        await asyncio.sleep(0)


async def until(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    """Waits for work on another thread (an inference batch) to show; fails, naming it, after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        await asyncio.sleep(0.001)


class FakeClock(Clock):
    """Time stands still until ``advance``; timers due then fire in order, each at its own time.

    ``reads`` counts calls to ``now``: a loop that polls the clock shows up in it.
    """

    def __init__(self, start: float = 1000.0) -> None:
        self._now = start
        self._timers: list[FakeTimer] = []
        self._order = itertools.count()
        self.reads = 0

    def now(self) -> float:
        self.reads += 1
        return self._now

    def call_later(self, delay: float, callback: Callable[..., Any], *args: Any) -> FakeTimer:
        timer = FakeTimer(self._now + max(0.0, delay), next(self._order), callback, args)
        heapq.heappush(self._timers, timer)
        return timer

    async def sleep(self, seconds: float) -> None:
        woken: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        timer = self.call_later(seconds, _resolve, woken)
        try:
            await woken
        finally:
            timer.cancel()

    async def wait(self, event: asyncio.Event, timeout: float) -> bool:
        if event.is_set():
            return True
        timed_out: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        timer = self.call_later(timeout, _resolve, timed_out)
        waiter = asyncio.ensure_future(event.wait())
        try:
            await asyncio.wait({waiter, timed_out}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            timer.cancel()
            waiter.cancel()
            timed_out.cancel()
        return event.is_set()

    async def advance(self, seconds: float) -> None:
        """Moves time on by ``seconds`` and lets the loop run what each timer due sets off."""
        target = self._now + seconds
        await turns()
        while self._timers and self._timers[0].when <= target:
            timer = heapq.heappop(self._timers)
            if timer.cancelled:
                continue
            self._now = max(self._now, timer.when)
            timer.callback(*timer.args)
            await turns()
        self._now = target
        await turns()

    def jump(self, seconds: float) -> None:
        """Moves time on without firing timers: for a clock only read, from another thread's event loop."""
        self._now += seconds
