from __future__ import annotations

import numpy as np
import pytest
import torch

from model.evaluate import (
    HeldOutTask,
    format_comparisons,
    pad_batch,
    prefix_comparisons,
    retrieval_ranks,
    scores_of,
    synset_bootstrap,
    tfidf_ranks,
)


def test_pad_batch_pads_right_and_masks() -> None:
    ids, mask = pad_batch([[5, 6, 7], [8]], pad=0)
    assert ids.tolist() == [[5, 6, 7], [8, 0, 0]]
    assert mask.tolist() == [[1, 1, 1], [1, 0, 0]]


def test_pad_batch_cuts_each_batch_to_its_own_longest_row() -> None:
    rows = [[5, 6, 7], [8], [9, 10], [11, 12, 13, 14]]
    for index in ([1, 2], [0, 3, 1], [2]):
        chosen = [rows[i] for i in index]
        ids, mask = pad_batch(chosen, pad=0)
        assert ids.shape == (len(chosen), max(map(len, chosen))) and ids.dtype == mask.dtype == torch.int64
        for row, tokens in enumerate(chosen):
            assert ids[row].tolist() == tokens + [0] * (ids.shape[1] - len(tokens))
            assert mask[row].tolist() == [1] * len(tokens) + [0] * (ids.shape[1] - len(tokens))


def test_retrieval_scores_on_a_known_ranking() -> None:
    docs = np.eye(3, dtype=np.float32)
    queries = np.array([[1, 0, 0], [0.9, 0.1, 0], [0, 0.2, 0.8]], dtype=np.float32)
    scores = scores_of(retrieval_ranks(queries, docs, targets=[0, 1, 2]))
    # ranks: 1, 2 (doc 0 is closer than doc 1), 1
    assert scores.recall_at_1 == pytest.approx(2 / 3)
    assert scores.recall_at_10 == 1.0
    assert scores.mrr == pytest.approx((1 + 0.5 + 1) / 3)


def test_tfidf_ranks_the_definition_sharing_the_querys_words_first() -> None:
    task = HeldOutTask(
        queries=["the dog barked at night", "a cat sat on the warm mat"],
        docs=["a warm mat where a cat sat", "a dog that barked", "an unrelated text about ships"],
        targets=[1, 0],
    )
    scores = scores_of(tfidf_ranks(task, task.docs + task.queries))
    assert scores.recall_at_1 == 1.0 and scores.mrr == 1.0
    swapped = scores_of(tfidf_ranks(HeldOutTask(task.queries, task.docs, [0, 1]), task.docs + task.queries))
    assert swapped.recall_at_1 == 0.0


def test_a_bootstrap_interval_has_the_width_sampling_gives_a_mean() -> None:
    hits = np.random.default_rng(1).random(2000) < 0.3  # 2,000 queries, each its own synset
    interval = synset_bootstrap(hits[:, None].astype(float), range(2000), lambda m: m[:, 0])
    assert interval.value == pytest.approx(hits.mean())
    assert interval.low < interval.value < interval.high
    normal_width = 2 * 1.96 * np.sqrt(hits.mean() * (1 - hits.mean()) / 2000)  # 0.040
    assert interval.high - interval.low == pytest.approx(normal_width, rel=0.2)


def test_a_bootstrap_resamples_whole_synsets_not_single_queries() -> None:
    # Ten synsets of 50 queries each, every query of a synset found or every one missed: ten draws, not 500.
    groups = np.repeat(np.arange(10), 50)
    hits = (groups < 5).astype(float)[:, None]
    interval = synset_bootstrap(hits, groups, lambda m: m[:, 0])
    assert interval.value == 0.5
    assert interval.high - interval.low > 0.3  # resampling the 500 queries alone would give about 0.09


def test_both_sides_of_a_comparison_come_from_the_same_resample() -> None:
    ranks = np.random.default_rng(2).integers(1, 30, size=400)
    same = {"trained": ranks, "trained @8": ranks.copy(), "teacher": ranks.copy()}
    task = HeldOutTask(queries=[""] * 400, docs=[""] * 100, targets=[i % 100 for i in range(400)])
    comparisons = prefix_comparisons(same, task, dims=[8], resamples=500)
    share, gap = comparisons["trained @8 recall@10 / trained"], comparisons["trained @8 recall@1 - teacher"]
    assert share == {"value": 1.0, "low": 1.0, "high": 1.0}  # independent resamples would spread around 1
    assert gap == {"value": 0.0, "low": 0.0, "high": 0.0}


def test_prefix_comparisons_on_known_ranks() -> None:
    task = HeldOutTask(queries=[""] * 4, docs=[""] * 4, targets=[0, 1, 2, 3])
    ranks = {
        "trained": np.array([1, 1, 5, 20]),  # recall@10 3/4
        "trained @8": np.array([1, 12, 5, 20]),  # recall@10 2/4, recall@1 1/4
        "teacher": np.array([1, 1, 1, 30]),  # recall@1 3/4
    }
    comparisons = prefix_comparisons(ranks, task, dims=[8], resamples=200)
    assert comparisons["trained @8 recall@10 / trained"]["value"] == pytest.approx(2 / 3)
    assert comparisons["trained @8 recall@1 - teacher"]["value"] == pytest.approx(1 / 4 - 3 / 4)
    without_teacher = prefix_comparisons({k: v for k, v in ranks.items() if k != "teacher"}, task, dims=[8])
    assert list(without_teacher) == ["trained @8 recall@10 / trained"]
    lines = format_comparisons(comparisons).splitlines()
    assert lines[0].startswith("trained @8 recall@10 / trained: 66.7% (95% interval ")
    assert lines[1].startswith("trained @8 recall@1 - teacher: -0.500 (95% interval ")
