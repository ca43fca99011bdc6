"""The time the batcher and the idle poll read and wait on, so tests can hand in a clock they move themselves.

``Clock`` is ``time.monotonic`` with the running event loop's timers. Every wait a component makes on
time goes through its clock: reading it, sleeping, waiting on an event with a timeout, a timer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, Protocol


class Timer(Protocol):
    def cancel(self) -> None: ...


class Clock:
    """Monotonic seconds, and waits on the running event loop's own timers."""

    now = staticmethod(time.monotonic)  # read several times a request: no Python frame around it

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    async def wait(self, event: asyncio.Event, timeout: float) -> bool:
        """Whether ``event`` was set within ``timeout`` seconds."""
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except TimeoutError:
            return False
        return True

    def call_later(self, delay: float, callback: Callable[..., Any], *args: Any) -> Timer:
        """``callback(*args)`` on the running loop after ``delay`` seconds."""
        return asyncio.get_running_loop().call_later(delay, callback, *args)


MONOTONIC = Clock()
