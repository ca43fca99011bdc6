"""Which queued items make the next batch, and how many padded tokens it may hold: server/batcher.py's rules,
as functions of the queue alone (the batcher calls them under its lock, on either thread).

A batch's cost on a padded backend is items x its longest item, so its padded tokens are what the limits count.
"""

from __future__ import annotations

from typing import Protocol, TypeVar

MEASURED_SHARE = 0.2  # of max_batch_seconds: batches predicted shorter do not move the budget


class Queued(Protocol):
    @property
    def length(self) -> int: ...


Item = TypeVar("Item", bound=Queued)


def take_sorted(
    queue: list[Item], *, max_items: int, max_padded_tokens: int, max_padding_ratio: float, sort_window: int
) -> tuple[list[Item], list[Item], int]:
    """The next batch from a non-empty queue in fair-queueing order: its first item, then, from the first
    ``sort_window`` items in length order, whichever neighbour adds the least padding, while padding stays at most
    ``max_padding_ratio`` of the batch's padded tokens. Returns the batch and the queue without it (both in queue
    order) and the batch's real tokens."""
    window = queue[:sort_window]
    by_length = sorted(range(len(window)), key=lambda i: (window[i].length, i))
    lo = hi = by_length.index(0)  # the oldest item's place in length order
    longest = real = window[0].length
    count = 1

    def padding_added(length: int) -> int | None:
        """Padding one more item adds, or None if it breaks a limit or the padding-ratio cap."""
        new_longest = max(longest, length)
        padded = (count + 1) * new_longest
        if count + 1 > max_items or padded > max_padded_tokens:
            return None
        if padded - (real + length) > max_padding_ratio * padded:
            return None
        return padded - count * longest - length  # a longer item pads every item already in

    while True:
        left = padding_added(window[by_length[lo - 1]].length) if lo > 0 else None
        right = padding_added(window[by_length[hi + 1]].length) if hi + 1 < len(by_length) else None
        if left is None and right is None:
            break
        if right is None or (left is not None and left <= right):
            lo -= 1
            added = window[by_length[lo]]
        else:
            hi += 1
            added = window[by_length[hi]]
        longest, real, count = max(longest, added.length), real + added.length, count + 1
    chosen = {by_length[i] for i in range(lo, hi + 1)}
    batch = [window[i] for i in sorted(chosen)]
    rest = [item for i, item in enumerate(window) if i not in chosen]
    rest.extend(queue[len(window) :])
    return batch, rest, real


def take_fifo(queue: list[Item], *, max_items: int, max_padded_tokens: int) -> tuple[list[Item], list[Item], int]:
    """The next batch in plain queue order up to the limits (the benchmark's baseline): the batch, the rest of the
    queue and the batch's real tokens."""
    count, longest = 0, 0
    for item in queue[:max_items]:
        if count and (count + 1) * max(longest, item.length) > max_padded_tokens:
            break
        count, longest = count + 1, max(longest, item.length)
    batch = queue[:count]
    return batch, queue[count:], sum(item.length for item in batch)


class BatchBudget:
    """The padded tokens a batch may hold now. At most ``max_tokens``; with ``max_batch_seconds`` set, each batch
    predicted (``fixed_seconds`` + ``seconds_per_token`` x its padded tokens, measured at warm-up) to take at least
    MEASURED_SHARE of it is compared with that prediction, and the budget shrinks by the slowdown seen (a flood's
    clients sharing the cores) and grows back as it passes."""

    def __init__(self, max_tokens: int, max_batch_seconds: float, fixed_seconds: float, seconds_per_token: float):
        self.tokens = max_tokens
        self._max_tokens = max_tokens
        self._max_batch_seconds = max_batch_seconds
        self._fixed_seconds = fixed_seconds
        self._seconds_per_token = seconds_per_token
        self._slowdown = 1.0  # batch times against the warm-up's, smoothed (at least 1)

    def observe(self, padded_tokens: int, seconds: float) -> bool:
        """Follows a finished batch's time; True when the budget changed."""
        if not (self._max_batch_seconds and self._seconds_per_token):
            return False
        predicted = self._fixed_seconds + self._seconds_per_token * padded_tokens
        if predicted < MEASURED_SHARE * self._max_batch_seconds:
            return False  # a small batch's time is mostly fixed costs (the hand-over, the call), not tokens
        self._slowdown = max(1.0, 0.5 * self._slowdown + 0.5 * seconds / predicted)
        fitting = (self._max_batch_seconds / self._slowdown - self._fixed_seconds) / self._seconds_per_token
        # Never so small that a batch's time can no longer be measured: then the slowdown could not pass.
        floor = (MEASURED_SHARE * self._max_batch_seconds - self._fixed_seconds) / self._seconds_per_token
        budget = max(1, min(self._max_tokens, round(max(fitting, floor))))
        if budget == self.tokens:
            return False
        self.tokens = budget
        return True
