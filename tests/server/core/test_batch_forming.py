from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from server.core.batch_forming import MEASURED_SHARE, BatchBudget, take_fifo, take_sorted


@dataclass(frozen=True)
class Text:
    position: int  # in the queue: ties in length would otherwise hide an item taken out of order
    length: int


def queue_of(lengths: list[int]) -> list[Text]:
    return [Text(i, n) for i, n in enumerate(lengths)]


def in_queue_order(items: list[Text]) -> bool:
    return [t.position for t in items] == sorted(t.position for t in items)


limits = st.fixed_dictionaries(
    {
        "max_items": st.integers(1, 40),
        "max_padded_tokens": st.integers(1, 2_000),
        "max_padding_ratio": st.sampled_from([0.0, 0.15, 0.4, 1.0]),
        "sort_window": st.integers(1, 60),
    }
)


@settings(max_examples=400, deadline=None)
@given(lengths=st.lists(st.integers(1, 128), min_size=1, max_size=120), limits=limits)
def test_a_sorted_batch_keeps_every_limit_and_takes_the_oldest(lengths: list[int], limits: dict) -> None:  # type: ignore[type-arg]
    queue = queue_of(lengths)
    batch, rest, real = take_sorted(queue, **limits)
    assert batch[0] is queue[0]  # the lowest fair-queueing tag always goes
    assert in_queue_order(batch) and in_queue_order(rest) and sorted(batch + rest, key=lambda t: t.position) == queue
    assert all(t.position < limits["sort_window"] for t in batch)
    assert real == sum(t.length for t in batch)
    padded = len(batch) * max(t.length for t in batch)
    if len(batch) > 1:  # a lone item goes whatever its size: nothing could ever take it otherwise
        assert len(batch) <= limits["max_items"] and padded <= limits["max_padded_tokens"]
        assert padded - real <= limits["max_padding_ratio"] * padded


@settings(max_examples=200, deadline=None)
@given(
    length=st.integers(1, 64),
    count=st.integers(1, 100),
    max_items=st.integers(1, 40),
    max_padded_tokens=st.integers(64, 2_000),
)
def test_equal_lengths_fill_a_sorted_batch_to_its_limits(
    length: int, count: int, max_items: int, max_padded_tokens: int
) -> None:
    batch, _, _ = take_sorted(
        queue_of([length] * count),
        max_items=max_items,
        max_padded_tokens=max_padded_tokens,
        max_padding_ratio=0.0,
        sort_window=512,
    )
    assert len(batch) == min(count, max_items, max_padded_tokens // length)


def test_a_sorted_batch_takes_the_oldest_items_neighbours_in_length() -> None:
    # The oldest is 10 tokens long: its neighbours in length (9, 11, 12) join before the 2- and 40-token items.
    queue = queue_of([10, 2, 40, 11, 9, 12])
    batch, rest, real = take_sorted(queue, max_items=4, max_padded_tokens=1_000, max_padding_ratio=1.0, sort_window=6)
    assert [t.length for t in batch] == [10, 11, 9, 12] and [t.length for t in rest] == [2, 40] and real == 42


@settings(max_examples=300, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 128), min_size=1, max_size=80),
    max_items=st.integers(1, 40),
    max_padded_tokens=st.integers(1, 2_000),
)
def test_a_fifo_batch_is_the_longest_front_of_the_queue_within_the_limits(
    lengths: list[int], max_items: int, max_padded_tokens: int
) -> None:
    queue = queue_of(lengths)
    batch, rest, real = take_fifo(queue, max_items=max_items, max_padded_tokens=max_padded_tokens)
    assert batch + rest == queue and batch and real == sum(lengths[: len(batch)])

    def fits(n: int) -> bool:
        return n <= max_items and n * max(lengths[:n]) <= max_padded_tokens

    assert len(batch) == 1 or fits(len(batch))
    assert len(batch) == len(queue) or not fits(len(batch) + 1)


def test_the_budget_shrinks_by_the_slowdown_and_grows_back() -> None:
    # 0.001 s a padded token at warm-up, batches meant to take at most 1 s: 1,000 tokens.
    budget = BatchBudget(max_tokens=1_000, max_batch_seconds=1.0, fixed_seconds=0.0, seconds_per_token=0.001)
    assert not budget.observe(padded_tokens=100, seconds=5.0)  # predicted under MEASURED_SHARE: not measured
    assert budget.observe(padded_tokens=1_000, seconds=3.0) and budget.tokens == 500  # 2x slower, smoothed
    assert budget.observe(padded_tokens=500, seconds=1.5) and budget.tokens == 400  # 2.5x now
    for _ in range(20):
        budget.observe(padded_tokens=budget.tokens, seconds=budget.tokens * 0.001)
    assert budget.tokens == 1_000  # back, never past max_tokens
    for _ in range(40):
        budget.observe(padded_tokens=budget.tokens, seconds=100.0)
    assert budget.tokens == round(MEASURED_SHARE / 0.001)  # never below what can still be measured


def test_the_budget_stands_still_without_a_time_limit() -> None:
    budget = BatchBudget(max_tokens=1_000, max_batch_seconds=0.0, fixed_seconds=0.0, seconds_per_token=0.001)
    assert not budget.observe(padded_tokens=1_000, seconds=50.0) and budget.tokens == 1_000
