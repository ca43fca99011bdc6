"""Token-budget dynamic batching: one queue item per input, batches formed by length, fair among clients.

Knows nothing of a protocol: requests are lists of token id rows, answers numpy arrays or domain errors.
Invariants: a batch holds at most ``max_batch_size`` items and ``max_batch_tokens`` padded tokens; a request
is admitted whole or refused whole (``max_queue_tokens``); items of a cancelled, failed or doomed request
leave the queue at once and are never computed; a failing batch fails only its own requests. The queue is
shared with the inference thread under a lock; futures, timers and observers are touched on the event loop
only. The policy in full: docs/architecture.md, "Batching".
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np

from server.core.batch_forming import BatchBudget, take_fifo, take_sorted
from server.core.clock import MONOTONIC, Clock, Timer
from server.core.errors import DeadlineExceeded, InferenceFailed, InvalidInput, NotReady, Overloaded

log = logging.getLogger(__name__)


class Backend(Protocol):
    """What a batch runs on: the batch's token id rows in, one float32 row per input out (server/backend/ort.py).
    Called on the batcher's inference thread, one batch at a time."""

    def __call__(self, rows: Sequence[np.ndarray], /) -> np.ndarray: ...


RESERVED_SHARE = 0.25  # of max_queue_tokens: room only short requests may take
SHORT_SHARE = 1 / 64  # of max_queue_tokens: a request this short may use the reserved room (1,024 by default)


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
    # Batch time at warm-up, fixed + per_token x padded tokens (OnnxRuntime.batch_cost). With max_batch_seconds,
    # the budget follows the load (server/batch_forming.py, BatchBudget); 0 = off.
    max_batch_seconds: float = 0.0
    fixed_batch_seconds: float = 0.0
    seconds_per_token: float = 0.0
    # A batch of at most this many padded tokens, with nothing else queued, runs on the event loop itself:
    # for one short text the hop to the inference thread and back is a large share of its wait, and with
    # nothing queued there is nothing for the loop to overlap (decisions/0015). 0 = never.
    inline_batch_tokens: int = 0

    def __post_init__(self) -> None:
        assert self.max_batch_tokens >= 1 and self.max_batch_size >= 1 and self.max_queue_tokens >= 1
        assert self.sort_window >= 1 and self.max_delay >= 0 and 0.0 <= self.max_padding_ratio <= 1.0
        assert self.max_batch_seconds >= 0 and self.fixed_batch_seconds >= 0 and self.seconds_per_token >= 0
        assert self.inline_batch_tokens >= 0


class BatchObserver:
    """Hooks for metrics; the defaults do nothing. Called on the event loop thread."""

    def dropped(self, reason: str, items: int) -> None: ...

    def batch_started(self, items: int, real_tokens: int, padded_tokens: int, queue_waits: list[float]) -> None: ...

    def batch_finished(self, seconds: float, ok: bool) -> None: ...

    # The padded tokens a batch may hold now: at start, and after every change (BatchPolicy.max_batch_seconds).
    def budget_changed(self, tokens: int) -> None: ...

    # Called with the queue's real contents after every change (submit, batch taken, items dropped).
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
    remaining: int = 0  # items not yet computed
    queued: int = 0  # items still waiting in the queue (not in a running batch)
    queue_seconds: float = 0.0
    inference_seconds: float = 0.0
    expired: bool = False
    timer: Timer | None = None
    client: str = ""


@dataclass(eq=False)
class _Item:
    request: _Request
    index: int
    row: np.ndarray
    enqueued_at: float
    tag: float  # virtual start time: the queue is kept in this order

    @property
    def length(self) -> int:
        return len(self.row)


def _tag(item: _Item) -> float:
    return item.tag


# Seconds: a request still queued this close to its deadline cannot make it. Besides a batch's time its
# answer must still be sent, the deadline we see is the client's shifted by the request's transit, and a
# loop timer on a loaded machine runs late (the GIL's switch interval alone is 5 ms).
MIN_DEADLINE_MARGIN = 0.02


class Batcher:
    def __init__(
        self,
        backend: Backend,
        policy: BatchPolicy,
        observer: BatchObserver | None = None,
        clock: Clock = MONOTONIC,
        on_backend_health: Callable[[bool], None] | None = None,
        unhealthy_after: int = 5,
        probe_rows: Sequence[np.ndarray] = (),
        probe_interval: float = 1.0,
    ) -> None:
        self._backend = backend
        self.policy = policy
        self._observer = observer or BatchObserver()
        self._clock = clock
        self._queue: list[_Item] = []  # in tag order
        self._queued_tokens = 0
        self._virtual_time = 0.0  # the tag of the item the last batch was formed around
        # Per client with requests unanswered: how many, and where its next item's tag starts (event loop only).
        self._unanswered: dict[str, int] = {}
        self._finish_tags: dict[str, float] = {}
        self._running: list[_Item] = []  # the batch in the backend now
        # Guards what the inference thread touches when it takes its next batch: the queue, its token count,
        # the virtual time, _running and each request's ``queued``.
        self._lock = threading.Lock()
        self._wakeup = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._closing = False  # refuse new requests
        self._stopping = False  # the loop ends after the running batch
        self._sweep_pending = False
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="inference")
        self._task: asyncio.Task[None] | None = None
        self._expected_batch_seconds = 0.0  # moving average of recent batch times
        self._budget = BatchBudget(
            policy.max_batch_tokens, policy.max_batch_seconds, policy.fixed_batch_seconds, policy.seconds_per_token
        )
        self._observer.budget_changed(self._budget.tokens)
        # A backend that fails every batch is reported unhealthy (health NOT_SERVING) and probed with
        # probe_rows every probe_interval seconds until a batch succeeds: once load balancers stop
        # sending, no real batch would ever tell it has recovered.
        self._on_backend_health = on_backend_health
        self._unhealthy_after = unhealthy_after
        self._consecutive_failures = 0
        self._healthy = True
        self._probe_rows = list(probe_rows)
        self._probe_interval = probe_interval
        self._probe_task: asyncio.Task[None] | None = None

    # ---- public API -------------------------------------------------------------------------
    @property
    def queued_items(self) -> int:
        return len(self._queue)

    @property
    def queued_tokens(self) -> int:
        return self._queued_tokens

    @property
    def batch_token_budget(self) -> int:
        """The padded tokens a batch may hold now."""
        return self._budget.tokens

    @property
    def healthy(self) -> bool:
        return self._healthy

    @property
    def backend(self) -> Backend:
        return self._backend

    def swap_backend(self, backend: Backend) -> Backend:
        """Runs the next batches on ``backend``; returns the one it replaces (tests and fault injection
        wrap a backend this way: gate it, count its batches, make it fail). Batches stop running on the event
        loop: only the backend measured at warm-up is known to be short enough for it."""
        previous, self._backend = self._backend, backend
        self.policy = replace(self.policy, inline_batch_tokens=0)
        return previous

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="batcher")
            self._task.add_done_callback(self._loop_ended)

    def check_room(self, tokens: int, client: str = "") -> None:
        """Raises InvalidInput if ``tokens`` can never be queued, Overloaded if they cannot be now."""
        del client  # room is by size; fairness between clients is the queue's order
        policy = self.policy
        if tokens > policy.max_queue_tokens:
            raise InvalidInput(
                f"the request needs at least {tokens} tokens, more than the server queues at once "
                f"({policy.max_queue_tokens}); split the request"
            )
        short = tokens <= policy.max_queue_tokens * SHORT_SHARE
        room = policy.max_queue_tokens if short else int(policy.max_queue_tokens * (1 - RESERVED_SHARE))
        if self._queued_tokens + tokens > room and self._queued_tokens > 0:  # an empty queue takes any that fits
            kept = "" if short else f"; the last {RESERVED_SHARE:.0%} is kept for short requests"
            raise Overloaded(
                f"queue full ({self._queued_tokens} of {policy.max_queue_tokens} tokens waiting{kept}); retry later"
            )

    async def submit(self, rows: Sequence[np.ndarray], deadline: float | None = None, client: str = "") -> EmbedResult:
        """Queue one request's token rows and wait for their embeddings, in order.

        ``deadline`` is on this batcher's clock (``time.monotonic`` unless one was handed in); ``client`` is the key
        the queue is shared fairly by. Raises NotReady while draining, Overloaded when the queue is
        full, DeadlineExceeded, InferenceFailed.
        """
        if self._closing:
            raise NotReady("the server is shutting down; retry on another replica")
        if not rows:
            raise InvalidInput("no inputs")
        tokens = sum(len(r) for r in rows)
        self.check_room(tokens, client)
        now = self._clock.now()
        loop = asyncio.get_running_loop()
        request = _Request(
            n=len(rows),
            deadline=deadline,
            admitted_at=now,
            future=loop.create_future(),
            remaining=len(rows),
            client=client,
        )
        request.queued = len(rows)
        with self._lock:
            # A client with requests still unanswered goes on from its last tag; one with none starts at the
            # virtual time, so a closed-loop client is not held back by the length of the text it sent before.
            waiting = self._unanswered.get(client, 0)
            tag = max(self._virtual_time, self._finish_tags[client]) if waiting else self._virtual_time
            self._unanswered[client] = waiting + 1
            for i, row in enumerate(rows):
                bisect.insort(self._queue, _Item(request, i, row, now, tag), key=_tag)
                tag += len(row)
            self._finish_tags[client] = tag
            self._queued_tokens += tokens
        self._idle.clear()
        self._publish_queue()
        if deadline is not None:
            self._arm_deadline(request)
        request.future.add_done_callback(lambda _: self._request_done(request))
        self._wakeup.set()
        # If the caller is cancelled, awaiting cancels the future too: its items are then swept out.
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

    async def close(self, timeout: float = 10.0) -> None:
        """Stop: the batch in the backend finishes and is answered; requests still queued get NotReady.

        Never blocks the event loop: a batch that outlasts ``timeout`` has its requests failed and is
        left to finish in its thread.
        """
        self._closing = self._stopping = True
        self._wakeup.set()
        if self._probe_task is not None:
            self._probe_task.cancel()
        if self._task is not None:
            _, pending = await asyncio.wait({self._task}, timeout=timeout)
            for task in pending:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        stopped = NotReady("the server stopped before this request ran")
        with self._lock:
            left, self._running, self._queue, self._queued_tokens = self._running + self._queue, [], [], 0
        self._fail(left, stopped)
        self._publish_queue()
        self._idle.set()
        self._executor.shutdown(wait=False)

    # ---- the loop ---------------------------------------------------------------------------
    async def _loop(self) -> None:
        while not self._stopping:
            if not self._queue:
                self._idle.set()
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            await self._wait_for_fill()
            if self._stopping:
                break
            batch = self._take_batch()
            if batch:
                await self._run(batch)

    def _loop_ended(self, task: asyncio.Task[None]) -> None:
        """Watchdog: a loop that died of a bug fails its batch and is restarted, never left dead."""
        if task.cancelled() or task.exception() is None or self._stopping:
            return
        log.error("the batch loop died; restarting it", exc_info=task.exception())
        with self._lock:
            running, self._running = self._running, []
        self._fail(running, InferenceFailed("internal error while running this batch"))
        self._note_failure()
        self._task = None
        self.start()

    async def _wait_for_fill(self) -> None:
        """At low load, let a batch fill for up to max_delay after its oldest item arrived."""
        while self._queue and not self._stopping:
            remaining = self._fill_wait(self._clock.now())
            if remaining <= 0:
                return
            self._wakeup.clear()
            if not await self._clock.wait(self._wakeup, remaining):
                return

    # ---- deadlines, cancellation and the queue's bookkeeping ----------------------------------
    def _deadline_margin(self) -> float:
        """How long before its deadline a request must leave the queue to have a chance."""
        return max(MIN_DEADLINE_MARGIN, self._expected_batch_seconds)

    def _arm_deadline(self, request: _Request) -> None:
        assert request.deadline is not None
        delay = request.deadline - self._deadline_margin() - self._clock.now()
        request.timer = self._clock.call_later(max(0.0, delay), self._deadline_due, request)

    def _cannot_meet_deadline(self, request: _Request, now: float) -> bool:
        return request.deadline is not None and now >= request.deadline - self._deadline_margin()

    def _expire(self, request: _Request) -> None:
        request.expired = True
        request.future.set_exception(DeadlineExceeded("the deadline would pass before this request could run"))

    def _deadline_due(self, request: _Request) -> None:
        """Fail a request whose deadline cannot be met while it still waits, before gRPC cancels it."""
        request.timer = None
        with self._lock:  # the inference thread may be taking its items into a batch right now
            if request.future.done() or request.queued == 0:
                return  # answered, or all its items are computing already
            if not self._cannot_meet_deadline(request, self._clock.now()):
                self._arm_deadline(request)  # batches got faster meanwhile: check again later
                return
            self._expire(request)

    def _request_done(self, request: _Request) -> None:
        waiting = self._unanswered[request.client] - 1
        if waiting:
            self._unanswered[request.client] = waiting
        else:  # the client's next request starts at the virtual time: nothing of it to keep
            del self._unanswered[request.client], self._finish_tags[request.client]
        if request.timer is not None:
            request.timer.cancel()
            request.timer = None
        if request.queued and not self._sweep_pending:
            # Failed, cancelled or expired with items still queued: free their room now, not at the
            # next batch, so admission and the queue gauges see the real queue.
            self._sweep_pending = True
            asyncio.get_running_loop().call_soon(self._drop_dead)

    def _drop_dead(self) -> None:
        """Remove items whose request is finished (cancelled, failed) or cannot meet its deadline."""
        self._sweep_pending = False
        now = self._clock.now()
        with self._lock:
            removed = self._remove_dead(now)
        self._account_removed(removed, now)
        if removed:
            self._publish_queue()

    def _remove_dead(self, now: float) -> list[_Item]:
        """The queue's part of _drop_dead, under the lock, on either thread: no future is touched."""
        alive: list[_Item] = []
        removed: list[_Item] = []
        for item in self._queue:
            request = item.request
            if request.future.done() or self._cannot_meet_deadline(request, now):
                removed.append(item)
                self._queued_tokens -= item.length
                request.queued -= 1
            else:
                alive.append(item)
        if removed:
            self._queue = alive
        return removed

    def _account_removed(self, removed: Sequence[_Item], now: float) -> None:
        """On the event loop: fail what was removed for its deadline, count every removal by its reason. The
        caller publishes the queue's new size."""
        if not removed:
            return
        dropped: dict[str, int] = {}
        for item in removed:
            request = item.request
            if not request.future.done():
                self._expire(request)  # the timer fires late when the loop is busy: the same rule here
            # gRPC cancels a handler at its deadline, or the client's cancellation arrives when the
            # request could no longer make it anyway: both are the deadline's.
            at_deadline = self._cannot_meet_deadline(request, now)
            if request.expired or (request.future.cancelled() and at_deadline):
                reason = "deadline"
            else:
                reason = "cancelled" if request.future.cancelled() else "failed"
            dropped[reason] = dropped.get(reason, 0) + 1
        for reason, count in dropped.items():
            self._observer.dropped(reason, count)
        if not self._queue:
            self._wakeup.set()  # a loop waiting for the batch to fill sees the queue is empty

    def _publish_queue(self) -> None:
        self._observer.queue_changed(len(self._queue), self._queued_tokens)

    @staticmethod
    def _fail(items: Sequence[_Item], error: Exception) -> None:
        for item in items:
            if not item.request.future.done():
                item.request.future.set_exception(error)

    # ---- forming a batch --------------------------------------------------------------------
    def _take_batch(self) -> list[_Item]:
        """On the event loop, when no batch is running: the next batch, now the backend's running one."""
        now = self._clock.now()
        with self._lock:
            batch, removed = self._take_locked(now)
        self._account_removed(removed, now)
        self._publish_queue()
        return batch

    def _take_locked(self, now: float) -> tuple[list[_Item], list[_Item]]:
        """Under the lock, on either thread: the next batch (made the running one) and the items removed
        from the queue before it was formed, for _account_removed on the event loop."""
        removed = self._remove_dead(now)
        if not self._queue:
            self._running = []
            return [], removed
        self._virtual_time = max(self._virtual_time, self._queue[0].tag)
        p = self.policy
        if p.length_sorted:
            batch, self._queue, real = take_sorted(
                self._queue,
                max_items=p.max_batch_size,
                max_padded_tokens=self._budget.tokens,
                max_padding_ratio=p.max_padding_ratio,
                sort_window=p.sort_window,
            )
        else:
            batch, self._queue, real = take_fifo(
                self._queue, max_items=p.max_batch_size, max_padded_tokens=self._budget.tokens
            )
        self._queued_tokens -= real
        for item in batch:
            item.request.queued -= 1
        self._running = batch
        return batch, removed

    def _fill_wait(self, now: float) -> float:
        """Seconds the queued next batch may still wait to fill (max_delay after its oldest item arrived); 0 or
        less once it leaves. The event loop's _wait_for_fill and the inference thread's take share this rule."""
        p = self.policy
        if p.max_delay <= 0 or len(self._queue) >= p.max_batch_size:
            return 0.0
        return self._queue[0].enqueued_at + p.max_delay - now

    async def _run(self, batch: list[_Item]) -> None:
        """Run ``batch``, and on the inference thread every batch that follows it without a pause."""
        started = self._clock.now()
        self._batch_started(batch, started)
        rows = [item.row for item in batch]
        if len(rows) * max(len(r) for r in rows) <= self.policy.inline_batch_tokens and not self._queue:
            output, error = self._call_backend(rows)
            with self._lock:
                self._running = []
            self._batch_done(batch, output, error, started, self._clock.now())
            return
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self._executor, self._run_in_thread, batch, started, loop)
        except asyncio.CancelledError:
            self._stopping = True  # the thread takes no further batch
            with self._lock:
                running, self._running = self._running, []
            self._fail(running, NotReady("the server stopped while this request ran"))
            raise
        # Any other exception is a bug between batches, not in one: the watchdog (_loop_ended) fails the
        # running batch and restarts the loop.

    def _run_in_thread(self, batch: list[_Item], started: float, loop: asyncio.AbstractEventLoop) -> None:
        """On the inference thread: run the batch, take the next one from the queue, hand the results to
        the event loop, repeat until the queue is empty. Touches no future, timer or observer."""
        while batch:
            output, error = self._call_backend([item.row for item in batch])
            finished = self._clock.now()
            with self._lock:
                # Not when stopping or with nothing queued, nor while a max_delay fill is still due (the
                # event loop's _wait_for_fill times that).
                if not self._stopping and self._queue and self._fill_wait(finished) <= 0:
                    following, removed = self._take_locked(finished)
                else:
                    following, removed, self._running = [], [], []
            try:
                loop.call_soon_threadsafe(self._batch_done, batch, output, error, started, finished, following, removed)
            except RuntimeError:  # the event loop is closed: nobody is left to answer
                return
            batch, started = following, finished

    def _call_backend(self, rows: list[np.ndarray]) -> tuple[np.ndarray | None, Exception | None]:
        """The backend's output for ``rows``, or the exception it raised: one bad batch must not take the
        server down."""
        try:
            return self._backend(rows), None
        except Exception as e:
            return None, e

    def _batch_started(self, batch: Sequence[_Item], started: float) -> None:
        lengths = [item.length for item in batch]
        waits = [started - item.enqueued_at for item in batch]
        self._observer.batch_started(len(batch), sum(lengths), len(batch) * max(lengths), waits)

    def _batch_done(
        self,
        batch: list[_Item],
        output: np.ndarray | None,
        error: Exception | None,
        started: float,
        finished: float,
        following: Sequence[_Item] = (),
        removed: Sequence[_Item] = (),
    ) -> None:
        """On the event loop: answer a finished batch; note the batch the inference thread took when it finished
        (started then) and the dead items it removed from the queue."""
        seconds = finished - started
        if error is None:
            try:
                self._scatter(batch, output, started, seconds)
            except Exception as e:  # a malformed output, or a bug: fail this batch only
                error = e
        if error is None:
            self._observer.batch_finished(seconds, ok=True)
            self._expected_batch_seconds = 0.7 * self._expected_batch_seconds + 0.3 * seconds
            if self._budget.observe(len(batch) * max(item.length for item in batch), seconds):
                self._observer.budget_changed(self._budget.tokens)
            self._note_success()
        else:
            self._fail(batch, InferenceFailed(f"inference failed for this batch ({type(error).__name__})"))
            log.error("inference failed for a batch of %d items", len(batch), exc_info=error)
            self._observer.batch_finished(seconds, ok=False)
            self._note_failure()
        self._account_removed(removed, finished)
        if following:
            self._batch_started(following, finished)
        if following or removed:
            self._publish_queue()

    @staticmethod
    def _check_output(output: object, rows: int) -> np.ndarray:
        if not isinstance(output, np.ndarray) or output.ndim != 2 or output.shape[0] != rows:
            shape = getattr(output, "shape", type(output).__name__)
            raise RuntimeError(f"backend returned {shape} for {rows} rows; expected ({rows}, dim)")
        return output

    def _scatter(self, batch: list[_Item], output: object, started: float, seconds: float) -> None:
        output = self._check_output(output, len(batch))
        # Each request with inputs in this batch waited until it started and pays its time once.
        for request in {id(item.request): item.request for item in batch}.values():
            request.queue_seconds = max(request.queue_seconds, started - request.admitted_at)
            request.inference_seconds += seconds
        for position, (row, item) in enumerate(zip(output, batch, strict=True)):
            request = item.request
            if request.future.done():
                continue
            if request.n == 1:  # most requests: a view of the batch's output, no copy
                request.results = output[position : position + 1]
            else:
                if request.results is None:
                    request.results = np.empty((request.n, output.shape[1]), dtype=np.float32)
                request.results[item.index] = row
            request.remaining -= 1
            if request.remaining == 0:
                request.future.set_result(
                    EmbedResult(request.results, request.queue_seconds, request.inference_seconds)
                )

    # ---- backend health ---------------------------------------------------------------------
    def _note_failure(self) -> None:
        self._consecutive_failures += 1
        if self._consecutive_failures >= self._unhealthy_after and self._healthy:
            self._healthy = False
            if self._on_backend_health:
                self._on_backend_health(False)
            if self._probe_rows and not self._stopping:
                self._probe_task = asyncio.get_running_loop().create_task(self._probe(), name="backend-probe")

    def _note_success(self) -> None:
        self._consecutive_failures = 0
        if not self._healthy:
            self._healthy = True
            if self._probe_task is not None:
                self._probe_task.cancel()
                self._probe_task = None
            if self._on_backend_health:
                self._on_backend_health(True)

    async def _probe(self) -> None:
        """While unhealthy: run a small batch now and then, so the backend can recover without traffic."""
        loop = asyncio.get_running_loop()
        while not self._healthy and not self._stopping:
            await self._clock.sleep(self._probe_interval)
            if self._running or self._queue:
                continue  # real batches are testing the backend
            try:
                output = await loop.run_in_executor(self._executor, self._backend, self._probe_rows)
                self._check_output(output, len(self._probe_rows))
            except Exception as e:
                log.warning("backend probe failed (%s: %s); still NOT_SERVING", type(e).__name__, e)
                continue
            log.info("backend probe succeeded")
            self._probe_task = None
            self._note_success()
