"""Token-budget dynamic batching with length sorting, admission control and deadlines.

Knows nothing of gRPC: requests are lists of token id rows, answers are numpy arrays or domain
errors. Policy (see docs/architecture.md):

* every input of every request is one queue item; a request's items are reassembled in order;
* a batch holds at most ``max_batch_size`` items and at most ``max_batch_tokens`` padded tokens
  (items x longest item, as TEI counts for padded backends);
* the oldest waiting item is always in the next batch (no starvation); around it, the batch is
  filled from the oldest ``sort_window`` items in length order, taking whichever neighbour adds
  the least padding, as long as padding stays under ``max_padding_ratio`` of the batch;
* when the backend is idle, a batch leaves at once (or after ``max_delay`` counted from the arrival
  of its oldest item); while a batch runs, the next one fills;
* admission: a request whose tokens would push the queue past ``max_queue_tokens`` is refused whole
  and at once; nothing of it is queued;
* items of a request that was cancelled, failed or is past its deadline are dropped before inference.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from server.errors import DeadlineExceeded, InferenceFailed, InvalidInput, NotReady, Overloaded

log = logging.getLogger(__name__)

RunBatch = Callable[[Sequence[np.ndarray]], np.ndarray]


@dataclass(frozen=True)
class BatchPolicy:
    max_batch_tokens: int = 16384
    max_batch_size: int = 128
    max_queue_tokens: int = 65536
    max_delay: float = 0.0  # seconds
    sort_window: int = 512  # items, oldest first, considered when forming a batch
    length_sorted: bool = True  # False: plain FIFO up to the limits (the benchmark's baseline)
    # Padding may be at most this share of a batch's padded tokens; items that would push it higher wait
    # for the next batch (which follows at once). On padded backends compute grows with items x longest,
    # so splitting mixed lengths costs one more call but saves far more compute.
    max_padding_ratio: float = 0.15

    def __post_init__(self) -> None:
        assert self.max_batch_tokens >= 1 and self.max_batch_size >= 1 and self.max_queue_tokens >= 1
        assert self.sort_window >= 1 and self.max_delay >= 0 and 0.0 <= self.max_padding_ratio <= 1.0


class BatchObserver:
    """Hooks for metrics; the defaults do nothing. Called on the event loop thread."""

    def dropped(self, reason: str, items: int) -> None: ...

    def batch_started(self, items: int, real_tokens: int, padded_tokens: int, queue_waits: list[float]) -> None: ...

    def batch_finished(self, seconds: float, ok: bool) -> None: ...

    def queue_changed(self, items: int, tokens: int) -> None: ...


@dataclass(frozen=True)
class EmbedResult:
    embeddings: np.ndarray  # (n, dim) float32, input order, not normalised
    queue_seconds: float  # admission -> start of the last batch holding one of its items
    inference_seconds: float  # summed inference time of the batches holding its items


@dataclass(eq=False)
class _Request:
    n: int
    deadline: float | None
    admitted_at: float
    future: asyncio.Future[EmbedResult]
    results: np.ndarray | None = None
    remaining: int = 0
    queue_seconds: float = 0.0
    inference_seconds: float = 0.0
    expired: bool = False


@dataclass(eq=False)
class _Item:
    request: _Request
    index: int
    row: np.ndarray
    enqueued_at: float

    @property
    def length(self) -> int:
        return len(self.row)


class Batcher:
    def __init__(
        self,
        run_batch: RunBatch,
        policy: BatchPolicy,
        observer: BatchObserver | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_backend_health: Callable[[bool], None] | None = None,
        unhealthy_after: int = 5,
    ) -> None:
        self.run_batch = run_batch  # public so tests and fault injection can wrap it
        self.policy = policy
        self._observer = observer or BatchObserver()
        self._clock = clock
        self._queue: list[_Item] = []
        self._queued_tokens = 0
        self._wakeup = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._closing = False
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="inference")
        self._task: asyncio.Task[None] | None = None
        # A backend that fails every batch is reported unhealthy (health NOT_SERVING) until one succeeds.
        self._on_backend_health = on_backend_health
        self._unhealthy_after = unhealthy_after
        self._consecutive_failures = 0

    # ---- public API -------------------------------------------------------------------------
    @property
    def queued_items(self) -> int:
        return len(self._queue)

    @property
    def queued_tokens(self) -> int:
        return self._queued_tokens

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="batcher")

    async def submit(self, rows: Sequence[np.ndarray], deadline: float | None = None) -> EmbedResult:
        """Queue one request's token rows and wait for their embeddings, in order.

        ``deadline`` is on this batcher's clock (``time.monotonic`` by default). Raises NotReady while
        draining, Overloaded when the queue is full, DeadlineExceeded, InferenceFailed.
        """
        if self._closing:
            raise NotReady("the server is shutting down; retry on another replica")
        if not rows:
            raise InvalidInput("no inputs")
        tokens = sum(len(r) for r in rows)
        if tokens > self.policy.max_queue_tokens:
            raise InvalidInput(
                f"the request has {tokens} tokens, more than the server queues at once "
                f"({self.policy.max_queue_tokens}); split it"
            )
        if self._queued_tokens + tokens > self.policy.max_queue_tokens:
            raise Overloaded(
                f"queue full ({self._queued_tokens} of {self.policy.max_queue_tokens} tokens waiting); retry later"
            )
        now = self._clock()
        request = _Request(
            n=len(rows),
            deadline=deadline,
            admitted_at=now,
            future=asyncio.get_running_loop().create_future(),
            remaining=len(rows),
        )
        self._queue.extend(_Item(request, i, row, now) for i, row in enumerate(rows))
        self._queued_tokens += tokens
        self._idle.clear()
        self._observer.queue_changed(len(self._queue), self._queued_tokens)
        self._wakeup.set()
        # If the caller is cancelled, awaiting cancels the future too: its items are then dropped.
        return await request.future

    async def drain(self, timeout: float | None = None) -> bool:
        """Refuse new work, then wait until every admitted item is answered. True if it finished."""
        self._closing = True
        self._wakeup.set()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False

    async def close(self) -> None:
        self._closing = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for item in self._queue:
            if not item.request.future.done():
                item.request.future.set_exception(NotReady("the server stopped before this request ran"))
        self._queue.clear()
        self._executor.shutdown(wait=True)

    # ---- the loop ---------------------------------------------------------------------------
    async def _loop(self) -> None:
        while True:
            if not self._queue:
                self._idle.set()
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            await self._wait_for_fill()
            batch = self._take_batch()
            if batch:
                await self._run(batch)

    async def _wait_for_fill(self) -> None:
        """At low load, let a batch fill for up to max_delay after its oldest item arrived."""
        if self.policy.max_delay <= 0:
            return
        while self._queue and len(self._queue) < self.policy.max_batch_size:
            remaining = self._queue[0].enqueued_at + self.policy.max_delay - self._clock()
            if remaining <= 0:
                return
            self._wakeup.clear()
            try:
                await asyncio.wait_for(self._wakeup.wait(), remaining)
            except TimeoutError:
                return

    def _drop_dead(self) -> None:
        """Remove items whose request is finished (cancelled, failed) or past its deadline."""
        now = self._clock()
        alive: list[_Item] = []
        dropped: dict[str, int] = {}
        for item in self._queue:
            request = item.request
            if not request.future.done() and request.deadline is not None and now >= request.deadline:
                request.expired = True
                request.future.set_exception(DeadlineExceeded("the deadline passed while the request was queued"))
            if request.future.done():
                reason = "cancelled" if request.future.cancelled() else "deadline" if request.expired else "failed"
                dropped[reason] = dropped.get(reason, 0) + 1
                self._queued_tokens -= item.length
            else:
                alive.append(item)
        if dropped:
            self._queue = alive
            for reason, count in dropped.items():
                self._observer.dropped(reason, count)

    def _take_batch(self) -> list[_Item]:
        self._drop_dead()
        if not self._queue:
            return []
        if not self.policy.length_sorted:
            return self._take_fifo()
        window = self._queue[: self.policy.sort_window]
        by_length = sorted(range(len(window)), key=lambda i: (window[i].length, i))
        lo = hi = by_length.index(0)  # the oldest item's place in length order
        longest = real = window[0].length
        count = 1

        def padding_added(length: int) -> int | None:
            """Padding one more item adds, or None if it breaks a limit or the padding-ratio cap."""
            new_longest = max(longest, length)
            padded = (count + 1) * new_longest
            if count + 1 > self.policy.max_batch_size or padded > self.policy.max_batch_tokens:
                return None
            if padded - (real + length) > self.policy.max_padding_ratio * padded:
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
        self._queue = [item for i, item in enumerate(window) if i not in chosen] + self._queue[len(window) :]
        self._queued_tokens -= real
        return batch

    def _take_fifo(self) -> list[_Item]:
        count, longest = 0, 0
        for item in self._queue[: self.policy.max_batch_size]:
            if count and (count + 1) * max(longest, item.length) > self.policy.max_batch_tokens:
                break
            count, longest = count + 1, max(longest, item.length)
        batch, self._queue = self._queue[:count], self._queue[count:]
        self._queued_tokens -= sum(item.length for item in batch)
        return batch

    async def _run(self, batch: list[_Item]) -> None:
        started = self._clock()
        rows = [item.row for item in batch]
        real_tokens = sum(len(r) for r in rows)
        padded_tokens = len(rows) * max(len(r) for r in rows)
        self._observer.queue_changed(len(self._queue), self._queued_tokens)
        self._observer.batch_started(len(batch), real_tokens, padded_tokens, [started - i.enqueued_at for i in batch])
        loop = asyncio.get_running_loop()
        try:
            output = await loop.run_in_executor(self._executor, self.run_batch, rows)
            if output.shape[0] != len(batch):
                raise RuntimeError(f"backend returned {output.shape[0]} rows for {len(batch)}")
        except Exception as e:  # one bad batch must not take the server down
            log.exception("inference failed for a batch of %d items", len(batch))
            self._observer.batch_finished(self._clock() - started, ok=False)
            self._consecutive_failures += 1
            if self._consecutive_failures == self._unhealthy_after and self._on_backend_health:
                self._on_backend_health(False)
            for item in batch:
                if not item.request.future.done():
                    item.request.future.set_exception(
                        InferenceFailed(f"inference failed for this batch ({type(e).__name__})")
                    )
            return
        seconds = self._clock() - started
        self._observer.batch_finished(seconds, ok=True)
        if self._consecutive_failures >= self._unhealthy_after and self._on_backend_health:
            self._on_backend_health(True)
        self._consecutive_failures = 0
        # Each request with inputs in this batch waited until it started and pays its time once.
        for request in {id(item.request): item.request for item in batch}.values():
            request.queue_seconds = max(request.queue_seconds, started - request.admitted_at)
            request.inference_seconds += seconds
        for row, item in zip(output, batch, strict=True):
            request = item.request
            if request.future.done():
                continue
            if request.results is None:
                request.results = np.empty((request.n, output.shape[1]), dtype=np.float32)
            request.results[item.index] = row
            request.remaining -= 1
            if request.remaining == 0:
                request.future.set_result(
                    EmbedResult(request.results, request.queue_seconds, request.inference_seconds)
                )
