"""The batcher alone, with a fake runtime that records every batch it is given."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence

import numpy as np
import pytest

from server.core.batcher import MIN_DEADLINE_MARGIN, Batcher, BatchObserver, BatchPolicy
from server.core.clock import MONOTONIC, Clock
from server.core.errors import DeadlineExceeded, InferenceFailed, InvalidInput, NotReady, Overloaded
from tests.fake_clock import FakeClock, turns, until


class FakeRuntime:
    """Embeds a row as [length, first id]; the first batch waits for `release` so a queue can build up."""

    def __init__(self, hold_first: bool = True) -> None:
        self.batches: list[list[int]] = []
        self.release = threading.Event()
        if not hold_first:
            self.release.set()
        self.fail_on: set[int] = set()
        self.entered = 0  # batches that reached the backend, the held one included

    def __call__(self, rows: Sequence[np.ndarray]) -> np.ndarray:
        self.entered += 1
        if not self.batches and not self.release.wait(10):
            raise AssertionError("the test never released the held batch")
        self.batches.append([len(r) for r in rows])
        if len(self.batches) in self.fail_on:
            raise RuntimeError("injected")
        return np.array([[len(r), r[0]] for r in rows], dtype=np.float32)


def row(length: int, tag: int = 1) -> np.ndarray:
    return np.full(length, tag, dtype=np.int64)


async def settle() -> None:
    """Lets the tasks just created run up to their wait: turns of the loop, no real time."""
    await turns()


async def held(runtime: FakeRuntime) -> None:
    """Waits for the first batch to reach the backend, where it is held until ``runtime.release``."""
    await until(lambda: runtime.entered >= 1, "the first batch held in the backend")


def test_batches_respect_token_budget_and_size_and_hold_similar_lengths() -> None:
    async def run() -> FakeRuntime:
        runtime = FakeRuntime()
        batcher = Batcher(runtime, BatchPolicy(max_batch_tokens=60, max_batch_size=4, max_queue_tokens=10_000))
        batcher.start()
        first = asyncio.create_task(batcher.submit([row(1)]))
        await held(runtime)  # the first batch is now running and held
        lengths = [2, 30, 3, 29, 4, 28, 5, 27, 6, 26, 7, 25]
        tasks = [asyncio.create_task(batcher.submit([row(n, tag=n)])) for n in lengths]
        await settle()
        runtime.release.set()
        results = await asyncio.gather(first, *tasks)
        for n, result in zip(lengths, results[1:], strict=True):
            assert result.embeddings.tolist() == [[n, n]]
        await batcher.close()
        return runtime

    runtime = asyncio.run(run())
    later = runtime.batches[1:]
    assert sorted(n for b in later for n in b) == sorted([2, 30, 3, 29, 4, 28, 5, 27, 6, 26, 7, 25])
    for batch in later:
        assert len(batch) <= 4 and len(batch) * max(batch) <= 60  # size and padded-token budget
        assert max(batch) - min(batch) <= 5  # short with short, long with long
    # FIFO would have padded pairs like (2, 30); length sorting keeps the waste low.
    waste = sum(len(b) * max(b) - sum(b) for b in later)
    assert waste / sum(len(b) * max(b) for b in later) < 0.15


def test_oldest_item_is_always_in_the_next_batch() -> None:
    async def run() -> FakeRuntime:
        runtime = FakeRuntime()
        batcher = Batcher(runtime, BatchPolicy(max_batch_tokens=1000, max_batch_size=2, max_queue_tokens=10_000))
        batcher.start()
        first = asyncio.create_task(batcher.submit([row(1)]))
        await held(runtime)
        old_long = asyncio.create_task(batcher.submit([row(40)]))
        shorts = [asyncio.create_task(batcher.submit([row(3)])) for _ in range(6)]
        await settle()
        runtime.release.set()
        await asyncio.gather(first, old_long, *shorts)
        await batcher.close()
        return runtime

    runtime = asyncio.run(run())
    assert 40 in runtime.batches[1]  # not starved behind the shorter, better-packing items


def test_a_request_is_split_across_batches_and_reassembled_in_order() -> None:
    async def run() -> tuple[np.ndarray, FakeRuntime]:
        runtime = FakeRuntime(hold_first=False)
        policy = BatchPolicy(max_batch_tokens=1000, max_batch_size=3, max_queue_tokens=10_000, max_padding_ratio=1.0)
        batcher = Batcher(runtime, policy)
        batcher.start()
        result = await batcher.submit([row(n, tag=100 + i) for i, n in enumerate([9, 1, 5, 1, 9, 3, 7])])
        await batcher.close()
        return result.embeddings, runtime

    embeddings, runtime = asyncio.run(run())
    assert embeddings[:, 1].tolist() == [100, 101, 102, 103, 104, 105, 106]
    assert embeddings[:, 0].tolist() == [9, 1, 5, 1, 9, 3, 7]
    assert len(runtime.batches) == 3


def test_admission_refuses_whole_requests_and_queues_nothing() -> None:
    async def run() -> None:
        runtime = FakeRuntime()
        batcher = Batcher(runtime, BatchPolicy(max_batch_tokens=100, max_batch_size=1, max_queue_tokens=20))
        batcher.start()
        first = asyncio.create_task(batcher.submit([row(5)]))
        await held(runtime)
        second = asyncio.create_task(batcher.submit([row(8), row(8)]))
        await settle()
        assert batcher.queued_tokens == 16
        with pytest.raises(Overloaded):
            await batcher.submit([row(3), row(2)])
        assert batcher.queued_tokens == 16 and batcher.queued_items == 2
        with pytest.raises(InvalidInput):
            await batcher.submit([row(21)])  # could never fit, even in an empty queue
        runtime.release.set()
        await asyncio.gather(first, second)
        assert (await batcher.submit([row(3), row(2)])).embeddings.shape == (2, 2)
        await batcher.close()

    asyncio.run(run())


def test_expired_and_cancelled_items_are_never_computed() -> None:
    async def run() -> FakeRuntime:
        runtime = FakeRuntime()
        clock = FakeClock()  # moved without firing its timers: the deadline passes while the batch runs
        batcher = Batcher(runtime, BatchPolicy(max_queue_tokens=10_000), clock=clock)
        batcher.start()
        loop = asyncio.get_running_loop()
        first = asyncio.create_task(batcher.submit([row(1)]))
        await held(runtime)

        expired = asyncio.create_task(batcher.submit([row(11), row(11)], deadline=clock.now() + 1.0))
        cancelled = asyncio.create_task(batcher.submit([row(12)]))
        kept = asyncio.create_task(batcher.submit([row(13)]))
        await settle()
        cancelled.cancel()
        clock.jump(2.0)  # past the deadline while it waits behind the running batch
        await settle()
        runtime.release.set()
        with pytest.raises(DeadlineExceeded):
            await expired
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        await asyncio.gather(first, kept)
        assert batcher.queued_tokens == 0
        await batcher.close()
        assert loop.is_running()
        return runtime

    runtime = asyncio.run(run())
    computed = [n for b in runtime.batches for n in b]
    assert computed == [1, 13]


def test_the_inference_thread_takes_the_next_batch_while_the_event_loop_is_busy() -> None:
    """A busy event loop delays answers, never the next batch: the inference thread takes it from the queue."""
    calls: list[int] = []
    release, second_ran = threading.Event(), threading.Event()

    def backend(rows: Sequence[np.ndarray]) -> np.ndarray:
        calls.append(len(rows))
        if len(calls) == 1 and not release.wait(10):
            raise AssertionError("the test never released the held batch")
        if len(calls) == 2:
            second_ran.set()
        return np.array([[len(r), r[0]] for r in rows], dtype=np.float32)

    async def run() -> bool:
        batcher = Batcher(backend, BatchPolicy(max_queue_tokens=10_000))
        batcher.start()
        first = asyncio.create_task(batcher.submit([row(1)]))
        await until(lambda: calls == [1], "the first batch held in the backend")
        queued = asyncio.create_task(batcher.submit([row(2, tag=7)]))
        await settle()
        assert batcher.queued_items == 1 and calls == [1]
        release.set()
        ran = second_ran.wait(5)  # holds the event loop, as parsing and answering other requests do
        results = await asyncio.gather(first, queued)
        assert [r.embeddings.tolist() for r in results] == [[[1, 1]], [[2, 7]]]
        await batcher.close()
        return ran

    assert asyncio.run(run()), "the second batch waited for the event loop"


def test_failed_batch_fails_only_its_requests() -> None:
    async def run() -> None:
        runtime = FakeRuntime(hold_first=False)
        runtime.fail_on = {1}
        batcher = Batcher(runtime, BatchPolicy(max_queue_tokens=10_000))
        batcher.start()
        with pytest.raises(InferenceFailed, match="RuntimeError"):
            await batcher.submit([row(4)])
        assert (await batcher.submit([row(4)])).embeddings.tolist() == [[4, 1]]
        await batcher.close()

    asyncio.run(run())


def test_drain_answers_admitted_work_and_refuses_new() -> None:
    async def run() -> None:
        runtime = FakeRuntime()
        batcher = Batcher(runtime, BatchPolicy(max_batch_size=1, max_queue_tokens=10_000))
        batcher.start()
        admitted = [asyncio.create_task(batcher.submit([row(n)])) for n in (2, 3, 4)]
        await settle()
        drain = asyncio.create_task(batcher.drain(timeout=5))
        await settle()
        with pytest.raises(NotReady):
            await batcher.submit([row(2)])
        runtime.release.set()
        assert await drain is True
        assert [r.embeddings[0, 0] for r in await asyncio.gather(*admitted)] == [2, 3, 4]
        await batcher.close()

    asyncio.run(run())


def test_an_idle_backend_takes_each_request_at_once_without_a_fill_window() -> None:
    async def run() -> list[list[int]]:
        runtime = FakeRuntime(hold_first=False)
        batcher = Batcher(runtime, BatchPolicy(max_queue_tokens=10_000, max_delay=0.0), clock=FakeClock())
        batcher.start()
        for _ in range(3):  # time stands still: no request waits for it
            await asyncio.wait_for(batcher.submit([row(3)]), 10)
        await batcher.close()
        return runtime.batches

    assert asyncio.run(run()) == [[3], [3], [3]]


def test_max_delay_lets_a_batch_fill_at_low_load() -> None:
    async def run() -> list[list[int]]:
        runtime = FakeRuntime(hold_first=False)
        clock = FakeClock()
        batcher = Batcher(runtime, BatchPolicy(max_queue_tokens=10_000, max_delay=0.6), clock=clock)
        batcher.start()
        requests = []
        for _ in range(3):  # 0.1 s apart
            requests.append(asyncio.create_task(batcher.submit([row(3)])))
            await clock.advance(0.1)
        assert runtime.batches == [], "a batch left before its oldest item had waited max_delay"
        await clock.advance(0.3)  # the oldest item has now waited 0.6 s
        await asyncio.wait_for(asyncio.gather(*requests), 10)
        await batcher.close()
        return runtime.batches

    assert asyncio.run(run()) == [[3, 3, 3]]


def test_the_inference_thread_leaves_an_underfilled_batch_to_the_max_delay_window() -> None:
    """After a batch, the thread takes the next one only when it is full or its oldest item has waited max_delay."""

    async def run() -> list[list[int]]:
        runtime = FakeRuntime()
        clock = FakeClock()
        batcher = Batcher(runtime, BatchPolicy(max_queue_tokens=10_000, max_delay=1.0), clock=clock)
        batcher.start()
        first = asyncio.create_task(batcher.submit([row(1)]))
        await clock.advance(1.0)  # the first batch leaves when its window closes, and is held in the backend
        await until(lambda: batcher.queued_items == 0, "the first batch taken")
        early = asyncio.create_task(batcher.submit([row(2)]))
        await settle()
        runtime.release.set()  # done while ``early`` has waited no time at all on the batcher's clock
        await asyncio.wait_for(first, 10)
        await settle()
        assert runtime.batches == [[1]], "the thread took an underfilled batch before its window closed"
        late = asyncio.create_task(batcher.submit([row(2)]))  # the same length: the padding cap keeps them together
        await clock.advance(1.0)
        await asyncio.wait_for(asyncio.gather(early, late), 10)
        await batcher.close()
        return runtime.batches

    assert asyncio.run(run()) == [[1], [2, 2]]


def test_fifo_policy_takes_items_in_arrival_order_within_the_budget() -> None:
    async def run() -> FakeRuntime:
        runtime = FakeRuntime()
        policy = BatchPolicy(max_batch_tokens=60, max_batch_size=4, max_queue_tokens=10_000, length_sorted=False)
        batcher = Batcher(runtime, policy)
        batcher.start()
        first = asyncio.create_task(batcher.submit([row(1)]))
        await held(runtime)
        tasks = [asyncio.create_task(batcher.submit([row(n)])) for n in [2, 30, 3, 29, 4, 28]]
        await settle()
        runtime.release.set()
        await asyncio.gather(first, *tasks)
        await batcher.close()
        return runtime

    runtime = asyncio.run(run())
    assert runtime.batches[1:] == [[2, 30], [3, 29], [4, 28]]  # arrival order; 3 x 30 would pass 60


def test_padding_cap_splits_mixed_lengths_even_when_all_would_fit() -> None:
    async def run(ratio: float) -> list[list[int]]:
        runtime = FakeRuntime()
        policy = BatchPolicy(
            max_batch_tokens=10_000, max_batch_size=64, max_queue_tokens=10_000, max_padding_ratio=ratio
        )
        batcher = Batcher(runtime, policy)
        batcher.start()
        first = asyncio.create_task(batcher.submit([row(1)]))
        await held(runtime)
        lengths = [4, 5, 4, 100, 96, 98, 30, 31, 29]
        tasks = [asyncio.create_task(batcher.submit([row(n)])) for n in lengths]
        await settle()
        runtime.release.set()
        await asyncio.gather(first, *tasks)
        await batcher.close()
        return runtime.batches[1:]

    capped = asyncio.run(run(0.15))
    assert sorted(sorted(b) for b in capped) == [[4, 4, 5], [29, 30, 31], [96, 98, 100]]
    for batch in capped:
        assert len(batch) * max(batch) - sum(batch) <= 0.15 * len(batch) * max(batch)
    assert asyncio.run(run(1.0)) == [[4, 5, 4, 100, 96, 98, 30, 31, 29]]  # no cap: one batch, 60% padding


class Recorder(BatchObserver):
    def __init__(self) -> None:
        self.queue: list[tuple[int, int]] = []
        self.drops: dict[str, int] = {}

    def queue_changed(self, items: int, tokens: int) -> None:
        self.queue.append((items, tokens))

    def dropped(self, reason: str, items: int) -> None:
        self.drops[reason] = self.drops.get(reason, 0) + items


async def held_batcher(
    clock: Clock = MONOTONIC,
) -> tuple[FakeRuntime, Recorder, Batcher, asyncio.Task]:  # type: ignore[type-arg]
    """A batcher whose first batch (one row) is running and held in the backend until runtime.release."""
    runtime = FakeRuntime()
    recorder = Recorder()
    batcher = Batcher(runtime, BatchPolicy(max_queue_tokens=10_000), observer=recorder, clock=clock)
    batcher.start()
    running = asyncio.create_task(batcher.submit([row(1)]))
    await held(runtime)
    return runtime, recorder, batcher, running


def test_a_malformed_backend_output_fails_only_its_batch_and_the_loop_serves_on() -> None:
    async def run() -> None:
        outputs = iter([np.zeros(1, dtype=np.float32)])  # 1-D: the right length, but no vector per input

        def backend(rows: Sequence[np.ndarray]) -> np.ndarray:
            return next(outputs, np.ones((len(rows), 2), dtype=np.float32))

        batcher = Batcher(backend, BatchPolicy(max_queue_tokens=10_000))
        batcher.start()
        with pytest.raises(InferenceFailed):
            await asyncio.wait_for(batcher.submit([row(3)]), 5)
        result = await asyncio.wait_for(batcher.submit([row(3)]), 5)  # the loop is alive
        assert result.embeddings.tolist() == [[1, 1]]
        await batcher.close()

    asyncio.run(run())


def test_a_batch_loop_that_dies_is_restarted_and_serves_the_queue() -> None:
    async def run() -> None:
        runtime = FakeRuntime(hold_first=False)
        batcher = Batcher(runtime, BatchPolicy(max_queue_tokens=10_000))
        take = batcher._take_batch
        calls = []

        def broken_once() -> list:  # type: ignore[type-arg]
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("a bug in batch forming")
            return take()

        batcher._take_batch = broken_once  # type: ignore[method-assign]
        batcher.start()
        result = await asyncio.wait_for(batcher.submit([row(4)]), 5)
        assert result.embeddings.tolist() == [[4, 1]] and len(calls) >= 2
        await batcher.close()

    asyncio.run(run())


def test_a_bug_in_the_inference_threads_take_fails_its_batch_and_the_queue_is_served() -> None:
    async def run() -> None:
        runtime = FakeRuntime()
        batcher = Batcher(runtime, BatchPolicy(max_queue_tokens=10_000))
        take = batcher._take_locked
        broken = threading.Event()

        def broken_in_the_thread(now: float) -> tuple[list, list]:  # type: ignore[type-arg]
            if threading.current_thread() is not threading.main_thread() and not broken.is_set():
                broken.set()
                raise RuntimeError("a bug in batch forming")
            return take(now)

        batcher._take_locked = broken_in_the_thread  # type: ignore[method-assign]
        batcher.start()
        running = asyncio.create_task(batcher.submit([row(1)]))
        await held(runtime)
        queued = asyncio.create_task(batcher.submit([row(2)]))
        await settle()
        runtime.release.set()
        with pytest.raises(InferenceFailed):
            await asyncio.wait_for(running, 5)  # its result was lost with the thread's step: failed, not left waiting
        assert (await asyncio.wait_for(queued, 5)).embeddings.tolist() == [[2, 1]]
        assert broken.is_set() and batcher.queued_items == 0
        await batcher.close()

    asyncio.run(run())


def test_queue_gauges_follow_cancellations_even_when_no_batch_follows() -> None:
    async def run() -> tuple[Recorder, Batcher]:
        runtime, recorder, batcher, running = await held_batcher()
        doomed = [asyncio.create_task(batcher.submit([row(5), row(6)])) for _ in range(3)]
        await settle()
        assert recorder.queue[-1] == (6, 33) == (batcher.queued_items, batcher.queued_tokens)
        for task in doomed:
            task.cancel()
        await settle()
        # The backend is still held: no batch has run since, yet the queue and its gauges are empty.
        assert recorder.queue[-1] == (0, 0) == (batcher.queued_items, batcher.queued_tokens)
        assert recorder.drops == {"cancelled": 6}
        runtime.release.set()
        await running
        await batcher.close()
        return recorder, batcher

    recorder, _ = asyncio.run(run())
    assert recorder.queue[-1] == (0, 0)


def test_queue_gauges_follow_what_the_inference_thread_drops_when_no_batch_follows() -> None:
    """Items whose deadline can no longer be met when a batch ends are dropped by the inference thread's take;
    with nothing left to run after them, the gauges still fall to zero."""

    async def run() -> None:
        clock = FakeClock()  # moved without firing its timers: the inference thread finds the deadline in reach
        runtime, recorder, batcher, running = await held_batcher(clock)
        doomed = asyncio.create_task(batcher.submit([row(5), row(6)], deadline=clock.now() + 10))
        await settle()
        assert recorder.queue[-1] == (2, 11)
        clock.jump(10.0)  # the deadline comes within reach while the first batch runs
        runtime.release.set()
        await running
        with pytest.raises(DeadlineExceeded):
            await asyncio.wait_for(doomed, 5)
        await settle()
        assert recorder.drops == {"deadline": 2}
        assert recorder.queue[-1] == (0, 0) == (batcher.queued_items, batcher.queued_tokens)
        await batcher.close()

    asyncio.run(run())


def test_a_deadline_that_cannot_be_met_fails_before_it_passes_and_is_never_computed() -> None:
    async def run() -> tuple[FakeRuntime, Recorder]:
        clock = FakeClock()
        runtime, recorder, batcher, running = await held_batcher(clock)
        deadline = clock.now() + 0.2
        doomed = asyncio.create_task(batcher.submit([row(7), row(7)], deadline=deadline))
        await clock.advance(0.2 - MIN_DEADLINE_MARGIN - 0.01)
        assert not doomed.done(), "failed earlier than the deadline's margin"
        await clock.advance(0.02)
        with pytest.raises(DeadlineExceeded):
            await asyncio.wait_for(doomed, 5)
        assert clock.now() < deadline  # failed by the server before the deadline, not at it
        await settle()
        assert recorder.drops == {"deadline": 2} and batcher.queued_items == 0
        runtime.release.set()
        await running
        await batcher.close()
        return runtime, recorder

    runtime, _ = asyncio.run(run())
    assert [n for b in runtime.batches for n in b] == [1]


def test_a_cancellation_too_close_to_the_deadline_to_make_it_counts_as_the_deadline() -> None:
    """The deadline we see is the client's shifted by transit, and a busy loop runs our timer late: the
    client's own cancellation at its deadline can come first. It is the deadline's, not a cancellation."""

    async def run() -> Recorder:
        clock = FakeClock()  # moved without firing its timers: the cancellation comes before the loop's timer
        runtime, recorder, batcher, running = await held_batcher(clock)
        early = asyncio.create_task(batcher.submit([row(3)], deadline=clock.now() + 10))
        late = asyncio.create_task(batcher.submit([row(4), row(4)], deadline=clock.now() + 10.01))
        await settle()
        early.cancel()  # 10 s before its deadline: the client went away
        await settle()
        clock.jump(10.0)  # ``late`` is 10 ms from its deadline, within the margin: it cannot make it
        late.cancel()
        await settle()
        runtime.release.set()
        await running
        await batcher.close()
        return recorder

    recorder = asyncio.run(run())
    assert recorder.drops == {"cancelled": 1, "deadline": 2}


def test_close_answers_the_running_batch_and_keeps_the_event_loop_free() -> None:
    async def run() -> None:
        runtime = FakeRuntime()
        batcher = Batcher(runtime, BatchPolicy(max_batch_size=1, max_queue_tokens=10_000))
        batcher.start()
        running = asyncio.create_task(batcher.submit([row(2)]))
        await held(runtime)
        queued = asyncio.create_task(batcher.submit([row(3)]))
        await settle()
        ticks = 0

        async def heartbeat() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        beating = asyncio.create_task(heartbeat())
        closing = asyncio.create_task(batcher.close())
        # close() waits for the held batch; the loop must keep running meanwhile. Waited for by ticks, not
        # a fixed sleep: a stalled machine once gave 9 ticks in 0.3 s. A close() that blocked the loop
        # would hold it until the held batch gives up (10 s), past this deadline, with no ticks.
        deadline = asyncio.get_running_loop().time() + 5
        while ticks < 10 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        assert ticks >= 10 and not closing.done()
        runtime.release.set()
        await asyncio.wait_for(closing, 5)
        assert (await asyncio.wait_for(running, 1)).embeddings.tolist() == [[2, 1]]  # answered, not abandoned
        with pytest.raises(NotReady):
            await queued
        beating.cancel()

    asyncio.run(run())


def test_an_unhealthy_backend_is_probed_and_recovers_without_traffic() -> None:
    async def run() -> list[bool]:
        broken = threading.Event()
        broken.set()

        calls = 0

        def backend(rows: Sequence[np.ndarray]) -> np.ndarray:
            nonlocal calls
            calls += 1
            if broken.is_set():
                raise RuntimeError("device lost")
            return np.ones((len(rows), 2), dtype=np.float32)

        reports: list[bool] = []
        clock = FakeClock()
        batcher = Batcher(
            backend,
            BatchPolicy(max_queue_tokens=10_000),
            clock=clock,
            on_backend_health=reports.append,
            unhealthy_after=2,
            probe_rows=[row(2)],
            probe_interval=1.0,
        )
        batcher.start()
        for _ in range(2):
            with pytest.raises(InferenceFailed):
                await batcher.submit([row(3)])
        assert reports == [False] and not batcher.healthy
        await clock.advance(0.9)
        assert calls == 2, "probed before the probe interval"
        for probes in range(1, 4):  # three probes run and fail: still unhealthy
            await clock.advance(1.0)
            await until(lambda n=probes: calls == 2 + n, f"probe {probes}")
        assert reports == [False]
        broken.clear()  # the backend recovers; no request is sent
        await clock.advance(1.0)
        await until(lambda: batcher.healthy, "the probe after recovery reporting healthy")
        await batcher.close()
        return reports

    assert asyncio.run(run()) == [False, True]


def test_a_short_request_from_another_client_goes_ahead_of_a_backlog() -> None:
    """Fair queueing: one client's 40 queued rows do not make another client's one row wait behind them."""

    async def run() -> FakeRuntime:
        runtime = FakeRuntime()
        policy = BatchPolicy(max_batch_tokens=40, max_batch_size=4, max_queue_tokens=10_000, max_padding_ratio=1.0)
        batcher = Batcher(runtime, policy)
        batcher.start()
        first = asyncio.create_task(batcher.submit([row(10)], client="flooder"))
        await held(runtime)  # held in the backend
        backlog = [asyncio.create_task(batcher.submit([row(10)] * 4, client="flooder")) for _ in range(10)]
        await settle()
        small = asyncio.create_task(batcher.submit([row(3, tag=7)], client="small"))
        await settle()
        runtime.release.set()
        await asyncio.gather(first, small, *backlog)
        await batcher.close()
        return runtime

    runtime = asyncio.run(run())
    # Batch 1 was running; the short row is in batch 2, not after the flooder's ten 4-row requests.
    assert 3 in runtime.batches[1], runtime.batches
    assert len(runtime.batches) == 12


def test_one_client_is_served_in_arrival_order() -> None:
    async def run() -> list[int]:
        runtime = FakeRuntime()
        batcher = Batcher(runtime, BatchPolicy(max_batch_tokens=10, max_batch_size=1, max_queue_tokens=10_000))
        batcher.start()
        first = asyncio.create_task(batcher.submit([row(1)], client="one"))
        await held(runtime)
        later = [asyncio.create_task(batcher.submit([row(n)], client="one")) for n in (5, 2, 9, 3)]
        await settle()
        runtime.release.set()
        await asyncio.gather(first, *later)
        await batcher.close()
        return [b[0] for b in runtime.batches]

    assert asyncio.run(run()) == [1, 5, 2, 9, 3]


def test_the_last_quarter_of_the_queue_takes_only_short_requests() -> None:
    async def run() -> None:
        runtime = FakeRuntime()
        # Short: at most 6,400 / 64 = 100 tokens. Large requests may fill 4,800 tokens, short ones 6,400.
        batcher = Batcher(runtime, BatchPolicy(max_batch_tokens=2000, max_batch_size=1, max_queue_tokens=6400))
        batcher.start()
        running = asyncio.create_task(batcher.submit([row(10)]))
        await held(runtime)
        queued = [asyncio.create_task(batcher.submit([row(1200)] * 2, client=f"c{i}")) for i in range(2)]
        await settle()
        assert batcher.queued_tokens == 4800
        with pytest.raises(Overloaded, match="kept for short requests"):
            await batcher.submit([row(200)], client="c0")
        shorts = [asyncio.create_task(batcher.submit([row(100)], client="small")) for _ in range(16)]
        await settle()
        assert batcher.queued_tokens == 6400  # the short ones filled the reserved quarter
        with pytest.raises(Overloaded, match=r"queue full \(6400 of 6400 tokens waiting\)"):
            await batcher.submit([row(2)], client="small")
        runtime.release.set()
        await asyncio.gather(running, *queued, *shorts)
        await batcher.close()

    asyncio.run(run())


def test_the_token_budget_shrinks_by_the_slowdown_under_load_and_grows_back() -> None:
    async def run() -> None:
        clock, slowdown = FakeClock(0.0), [1.0]  # the batcher's clock; how much slower than at warm-up batches run

        def backend(rows: Sequence[np.ndarray]) -> np.ndarray:
            clock.jump((0.01 + 1e-4 * len(rows) * max(len(r) for r in rows)) * slowdown[0])
            return np.ones((len(rows), 2), dtype=np.float32)

        # At warm-up: 10 ms a batch plus 0.1 ms a padded token, so 900 tokens run in 0.1 s.
        policy = BatchPolicy(
            max_batch_tokens=900,
            max_queue_tokens=100_000,
            max_batch_seconds=0.1,
            fixed_batch_seconds=0.01,
            seconds_per_token=1e-4,
        )
        budgets: list[int] = []
        observer = BatchObserver()
        observer.budget_changed = budgets.append  # type: ignore[method-assign]
        batcher = Batcher(backend, policy, observer=observer, clock=clock)
        batcher.start()

        async def load(length: int) -> None:  # 10,000 tokens in rows of one length
            requests = (batcher.submit([row(length)]) for _ in range(10_000 // length))
            await asyncio.wait_for(asyncio.gather(*requests), 10)

        await load(10)
        await load(3)  # batches of short rows: as fast as predicted, so no slower
        assert batcher.batch_token_budget == 900
        slowdown[0] = 4.0  # every batch four times slower: a flood's clients share the cores
        await load(10)
        assert 140 <= batcher.batch_token_budget <= 170  # towards the 150 tokens that run in 0.1 s now
        slowdown[0] = 1.0
        await load(10)
        assert batcher.batch_token_budget == 900  # back, never past max_batch_tokens
        assert budgets[0] == 900 and min(budgets) < 170 and budgets[-1] == 900  # each change reported (metrics)
        await batcher.close()

    asyncio.run(run())


def test_a_short_batch_with_nothing_queued_runs_on_the_event_loop_and_any_other_on_the_inference_thread() -> None:
    threads: list[tuple[int, str]] = []  # (longest row, thread) per batch

    def backend(rows: Sequence[np.ndarray]) -> np.ndarray:
        threads.append((max(len(r) for r in rows), threading.current_thread().name))
        return np.zeros((len(rows), 2), dtype=np.float32)

    async def run(inline_batch_tokens: int) -> None:
        policy = BatchPolicy(max_batch_size=1, max_padding_ratio=1.0, inline_batch_tokens=inline_batch_tokens)
        batcher = Batcher(backend, policy)
        batcher.start()
        await batcher.submit([row(4)])  # alone and short
        await batcher.submit([row(5)])  # alone, longer than the limit
        # Two short ones at once: the first batch leaves the second queued behind it, and the inference thread,
        # awake already, takes that one itself.
        await asyncio.gather(batcher.submit([row(3)]), batcher.submit([row(2)]))
        batcher.swap_backend(backend)  # another backend: its speed was never measured
        await batcher.submit([row(1)])
        await batcher.close()

    loop_thread = threading.current_thread().name
    asyncio.run(run(inline_batch_tokens=4))
    on_loop = [length for length, name in threads if name == loop_thread]
    assert on_loop == [4] and len(threads) == 5 and all(name.startswith("inference") for _, name in threads[1:])
    threads.clear()
    asyncio.run(run(inline_batch_tokens=0))
    assert len(threads) == 5 and all(name.startswith("inference") for _, name in threads)


def test_a_client_with_nothing_unanswered_is_not_held_back_by_the_length_it_sent_before() -> None:
    """Fair queueing carries a client's tags on only while it has requests unanswered: a closed-loop client whose
    long text was answered queues its next one at the virtual time, as a new client would, not a long text's worth
    of tokens behind (which made the slowest requests several times the median)."""
    gate = threading.Semaphore(0)
    order: list[int] = []

    def backend(rows: Sequence[np.ndarray]) -> np.ndarray:
        if not gate.acquire(timeout=10):
            raise AssertionError("the test never let this batch run")
        order.extend(int(r[0]) for r in rows)
        return np.array([[len(r), r[0]] for r in rows], dtype=np.float32)

    async def run() -> list[int]:
        batcher = Batcher(backend, BatchPolicy(max_batch_size=1, max_queue_tokens=10_000))
        batcher.start()
        held = asyncio.create_task(batcher.submit([row(1, tag=1)], client="z"))
        await until(lambda: batcher.queued_items == 0, "the first batch in the backend")
        first = [
            asyncio.create_task(batcher.submit([row(n, tag=t)], client=c)) for n, t, c in ((60, 2, "a"), (5, 3, "b"))
        ]
        await turns()
        for _ in range(3):
            gate.release()
        await asyncio.wait_for(asyncio.gather(held, *first), 10)  # "a" sent 60 tokens and has its answer
        order.clear()
        held = asyncio.create_task(batcher.submit([row(1, tag=1)], client="z"))
        await until(lambda: batcher.queued_items == 0, "the next batch in the backend")
        later = [
            asyncio.create_task(batcher.submit([row(5, tag=t)], client=c)) for t, c in ((3, "b"), (2, "a"), (4, "c"))
        ]
        await turns()
        for _ in range(4):
            gate.release()
        await asyncio.wait_for(asyncio.gather(held, *later), 10)
        await batcher.close()
        return order

    assert asyncio.run(run()) == [1, 3, 2, 4]  # "a" in its arrival place, not behind the newcomer "c"
