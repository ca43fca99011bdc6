"""The event loops the server can run on (``--event-loop``), and running a coroutine on one.

uvloop (libuv) is the default: every request passes through the event-loop thread, and uvloop's
futures, callbacks and wake-ups from other threads cost less CPU than asyncio's own loop
(docs/decisions/0004). asyncio's loop stays available as the plain reference.
"""

from __future__ import annotations

import asyncio
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
