from __future__ import annotations

import numpy as np
import pytest
import torch

from model.evaluate import HeldOutTask, pad_batch, retrieval_scores, tfidf_scores


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
    scores = retrieval_scores(queries, docs, targets=[0, 1, 2])
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
    scores = tfidf_scores(task, task.docs + task.queries)
    assert scores.recall_at_1 == 1.0 and scores.mrr == 1.0
    swapped = tfidf_scores(HeldOutTask(task.queries, task.docs, [0, 1]), task.docs + task.queries)
    assert swapped.recall_at_1 == 0.0
