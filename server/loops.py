"""The event loops the server can run on (``--event-loop``), running a coroutine on one, and the idle poll
that keeps the running loop awake for a while after its last answer (``--idle-poll-us``).

uvloop (libuv) is the default: every request passes through the event-loop thread, and uvloop's
futures, callbacks and wake-ups from other threads cost less CPU than asyncio's own loop
(docs/performance.md, "What was tried"). asyncio's loop stays available as the plain reference.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def _uvloop() -> asyncio.AbstractEventLoop:
    import uvloop  # imported when chosen, so --event-loop asyncio works where uvloop is not installed

    return uvloop.new_event_loop()


EVENT_LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "uvloop": _uvloop,
    "asyncio": asyncio.new_event_loop,
}


def run(coroutine: Coroutine[Any, Any, T], event_loop: str) -> T:
    """``asyncio.run`` on the named loop."""
    with asyncio.Runner(loop_factory=EVENT_LOOPS[event_loop]) as runner:
        return runner.run(coroutine)


def running_loop_name() -> str:
    """The running loop's package, as the startup log reports it: "uvloop" or "asyncio"."""
    return type(asyncio.get_running_loop()).__module__.partition(".")[0]


class IdlePoll:
    """Keeps the event loop polling its sockets for ``window`` seconds after the last request in progress is
    answered, instead of going to sleep in epoll at once.

    A lone client's next request comes a fraction of a millisecond after its answer. A loop asleep by then, on a
    core that has gone idle, is woken first, and on a 2-core VM that wake-up was about a tenth of a one-client
    request's time (docs/decisions/0031). Under load a request is always in progress, so the loop never polls; at
    one client it spends at most ``window`` of one core after each answer.
    """

    def __init__(self, window: float, busy: Callable[[], bool]) -> None:
        self.window = window
        self._busy = busy  # a request is in progress: the loop has work, and will not sleep before it is answered
        self._until = 0.0
        self._task: asyncio.Task[None] | None = None

    @property
    def polling(self) -> bool:
        return self._task is not None

    def start(self) -> None:
        """Called on the loop when a request leaves its handler; polls unless another is in progress."""
        if self.window <= 0 or self._busy():
            return
        self._until = time.perf_counter() + self.window
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._poll())

    async def _poll(self) -> None:
        try:
            while not self._busy() and time.perf_counter() < self._until:
                await asyncio.sleep(0)  # one turn of the loop: its sockets polled without a timeout
        finally:
            self._task = None
