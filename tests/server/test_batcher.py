"""The batcher alone, with a fake runtime that records every batch it is given."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence

import numpy as np
import pytest

from server.batcher import Batcher, BatchPolicy
from server.errors import DeadlineExceeded, InferenceFailed, InvalidInput, NotReady, Overloaded


class FakeRuntime:
    """Embeds a row as [length, first id]; the first batch waits for `release` so a queue can build up."""

    def __init__(self, hold_first: bool = True) -> None:
        self.batches: list[list[int]] = []
        self.release = threading.Event()
        if not hold_first:
            self.release.set()
        self.fail_on: set[int] = set()

    def __call__(self, rows: Sequence[np.ndarray]) -> np.ndarray:
        if not self.batches:
            self.release.wait(5)
        self.batches.append([len(r) for r in rows])
        if len(self.batches) in self.fail_on:
            raise RuntimeError("injected")
        return np.array([[len(r), r[0]] for r in rows], dtype=np.float32)


def row(length: int, tag: int = 1) -> np.ndarray:
    return np.full(length, tag, dtype=np.int64)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0.01)


def test_batches_respect_token_budget_and_size_and_hold_similar_lengths() -> None:
    async def run() -> FakeRuntime:
        runtime = FakeRuntime()
        batcher = Batcher(runtime, BatchPolicy(max_batch_tokens=60, max_batch_size=4, max_queue_tokens=10_000))
        batcher.start()
        first = asyncio.create_task(batcher.submit([row(1)]))
        await settle()  # the first batch is now running and held
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
        await settle()
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
        await settle()
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
        batcher = Batcher(runtime, BatchPolicy(max_queue_tokens=10_000))
        batcher.start()
        loop = asyncio.get_running_loop()
        first = asyncio.create_task(batcher.submit([row(1)]))
        await settle()
        import time

        expired = asyncio.create_task(batcher.submit([row(11), row(11)], deadline=time.monotonic() + 0.01))
        cancelled = asyncio.create_task(batcher.submit([row(12)]))
        kept = asyncio.create_task(batcher.submit([row(13)]))
        await settle()
        cancelled.cancel()
        await asyncio.sleep(0.05)
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


def test_max_delay_lets_a_batch_fill_at_low_load() -> None:
    async def run(delay: float) -> list[list[int]]:
        runtime = FakeRuntime(hold_first=False)
        batcher = Batcher(runtime, BatchPolicy(max_queue_tokens=10_000, max_delay=delay))
        batcher.start()

        async def late(n: int) -> None:
            await asyncio.sleep(0.02 * n)
            await batcher.submit([row(3)])

        await asyncio.gather(*(late(n) for n in range(3)))
        await batcher.close()
        return runtime.batches

    assert len(asyncio.run(run(0.0))) == 3  # idle backend: each request leaves at once
    assert len(asyncio.run(run(0.2))) == 1  # a fill window gathers the three


def test_fifo_policy_takes_items_in_arrival_order_within_the_budget() -> None:
    async def run() -> FakeRuntime:
        runtime = FakeRuntime()
        policy = BatchPolicy(max_batch_tokens=60, max_batch_size=4, max_queue_tokens=10_000, length_sorted=False)
        batcher = Batcher(runtime, policy)
        batcher.start()
        first = asyncio.create_task(batcher.submit([row(1)]))
        await settle()
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
        await settle()
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
