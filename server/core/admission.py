"""Admission before a request body is read or parsed: one budget for the process, every protocol and model.

``enter(client)`` takes a place for a call whose body is about to be read (at most ``max_calls``);
``receive(nbytes)`` takes the body's bytes before it is parsed or read (at most ``max_bytes``). The last
``RESERVED_SHARE`` of each is kept for clients holding no place and for small bodies, so one client's flood
cannot lock another out. Each returns a ticket released once the request no longer holds its body; past a
budget the request is refused with ``Overloaded`` naming it, its body never parsed.
"""

from __future__ import annotations

from collections.abc import Callable

from server.core.errors import Overloaded

RESERVED_SHARE = 0.25  # of each budget: kept for clients holding nothing (calls) or small bodies (bytes)
SMALL_SHARE = 1 / 64  # of max_bytes: a body this small may use the reserved bytes


class Ticket:
    """What one request holds; released once (explicitly, or when the ticket is freed)."""

    __slots__ = ("_give_back",)

    def __init__(self, give_back: Callable[[], None]) -> None:
        self._give_back: Callable[[], None] | None = give_back

    def release(self) -> None:
        give_back, self._give_back = self._give_back, None
        if give_back is not None:
            give_back()

    def __del__(self) -> None:  # a path that forgot to release (an interceptor's refusal, say) still frees it
        self.release()


class Admission:
    def __init__(self, max_bytes: int, max_calls: int) -> None:
        self.max_bytes = max_bytes
        self.max_calls = max_calls
        self.held_bytes = 0
        self.calls = 0
        self._calls_by_client: dict[str, int] = {}

    def resize(self, max_bytes: int, max_calls: int) -> None:
        assert max_bytes >= 1 and max_calls >= 1
        self.max_bytes, self.max_calls = max_bytes, max_calls

    def enter(self, client: str) -> Ticket:
        """A place for one call of ``client`` (a connection) about to read its body, or Overloaded."""
        held = self._calls_by_client.get(client, 0)
        room = self.max_calls if held == 0 else int(self.max_calls * (1 - RESERVED_SHARE))
        if self.calls >= room:
            kept = "" if held == 0 else f"; the last {RESERVED_SHARE:.0%} is kept for other connections"
            raise Overloaded(
                f"request bodies in progress full ({self.calls} of {self.max_calls} calls reading or "
                f"tokenizing, {held} of them this connection's{kept}); retry later"
            )
        self.calls += 1
        self._calls_by_client[client] = held + 1

        def leave() -> None:
            self.calls -= 1
            left = self._calls_by_client[client] - 1
            if left:
                self._calls_by_client[client] = left
            else:
                del self._calls_by_client[client]

        return Ticket(leave)

    def receive(self, nbytes: int) -> Ticket:
        """Hold ``nbytes`` of body for a request about to be parsed (or read), or raise Overloaded."""
        small = nbytes <= self.max_bytes * SMALL_SHARE
        room = self.max_bytes if small else int(self.max_bytes * (1 - RESERVED_SHARE))
        if self.held_bytes + nbytes > room:
            kept = "" if small else f"; the last {RESERVED_SHARE:.0%} is kept for small requests"
            raise Overloaded(
                f"request bytes budget full ({self.held_bytes} of {self.max_bytes} bytes of request bodies "
                f"held, this one has {nbytes}{kept}); retry later"
            )
        self.held_bytes += nbytes

        def give_back() -> None:
            self.held_bytes -= nbytes

        return Ticket(give_back)
