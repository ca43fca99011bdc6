"""Keeps the event loop polling its sockets for a while after its last answer (``--idle-poll-us``).

A lone client's next request comes a fraction of a millisecond after its answer; a loop asleep in epoll
by then is woken first, on a core that may have gone idle (docs/decisions/0031). Under load a request is
always in progress, so the loop never polls; at one client it spends at most ``window`` of one core
after each answer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from server.core.clock import MONOTONIC, Clock


class IdlePoll:
    def __init__(self, window: float, busy: Callable[[], bool], clock: Clock = MONOTONIC) -> None:
        self.window = window
        self.clock = clock
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
        self._until = self.clock.now() + self.window
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._poll())

    async def _poll(self) -> None:
        try:
            while not self._busy() and self.clock.now() < self._until:
                await asyncio.sleep(0)  # one turn of the loop: its sockets polled without a timeout
        finally:
            self._task = None
