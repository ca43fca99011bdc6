from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from model.checkpoint import encode_texts
from model.losses import info_nce
from model.train import TrainConfig, lr_at, train
from tests.conftest import tiny_train_config


def test_encode_texts_gives_unpadded_rows_with_sep_last(tiny_training) -> None:
    tokenizer = tiny_training[0].tokenizer
    padding_before = tokenizer.padding
    rows = encode_texts(tokenizer, ["a dog", "a dog that barked at the moon all night long"], max_len=6)
    cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    assert rows[0] == tokenizer.encode("a dog").ids[: len(rows[0])] and len(rows[0]) < 6  # no padding
    assert len(rows[1]) == 6 and rows[1][0] == cls and rows[1][-1] == sep  # cut to 6, [SEP] still last
    assert tokenizer.padding == padding_before  # the caller's tokenizer is left as it was


def test_learning_rate_warms_up_then_decays_to_zero() -> None:
    config = TrainConfig(steps=100, warmup_steps=10, lr=1.0)
    assert lr_at(0, config) == pytest.approx(0.1)
    assert lr_at(9, config) == pytest.approx(1.0)
    assert lr_at(55, config) == pytest.approx(0.5, abs=0.02)
    assert lr_at(100, config) == pytest.approx(0.0, abs=1e-9)


def test_training_is_reproducible_with_a_seed() -> None:
    config = tiny_train_config()
    first, second = train(config), train(config)
    assert first.losses == second.losses
    assert first.evaluation == second.evaluation


def test_tiny_training_reports_all_three_evaluations(tiny_training) -> None:
    result, out = tiny_training
    assert set(result.evaluation) == {"untrained", "tfidf", "trained", "trained @16"}  # 16: a trained prefix
    for scores in result.evaluation.values():
        assert 0.0 <= scores["recall_at_1"] <= scores["recall_at_10"] <= 1.0
    assert all(np.isfinite(result.losses)) and len(result.losses) == 12
    assert (out / "checkpoint.pt").is_file() and (out / "tokenizer.json").is_file()
    assert result.summary["held_out_queries"] > 0
    ((name, share),) = result.summary["prefix_comparisons"].items()  # no teacher: the share at 16 alone
    assert name == "trained @16 recall@10 / trained" and share["low"] <= share["value"] <= share["high"]


def test_the_matryoshka_loss_changes_training_when_on_and_not_when_off() -> None:
    from model.losses import matryoshka_loss

    a, b = torch.randn(8, 32), torch.randn(8, 32)
    assert float(matryoshka_loss(a, b, (), 0.05)) == 0.0
    prefix = float(matryoshka_loss(a, b, (16,), 0.05))
    assert prefix == pytest.approx(float(info_nce(a[:, :16], b[:, :16], 0.05)))
    off = train(tiny_train_config(matryoshka_dims=()))
    on = train(tiny_train_config(matryoshka_dims=(16,), matryoshka_weight=0.5))
    assert off.losses != on.losses  # the prefix loss is in the gradient
    assert off.summary["matryoshka_dims"] == [32] and on.summary["matryoshka_dims"] == [16, 32]
    again = train(tiny_train_config(matryoshka_dims=()))
    assert again.losses == off.losses  # and off, training is what it was (seeded)
    weightless = train(tiny_train_config(matryoshka_dims=(16,), matryoshka_weight=0.0))  # the default weight
    assert weightless.losses == off.losses and weightless.summary["matryoshka_dims"] == [16, 32]  # evaluated only
    lighter = train(tiny_train_config(matryoshka_dims=(16,), matryoshka_weight=0.25))
    assert lighter.losses != on.losses and lighter.summary["matryoshka_weight"] == 0.25  # the weight reaches the loss
    with pytest.raises(ValueError, match="matryoshka_dims"):
        tiny_train_config(matryoshka_dims=(32,))


@pytest.mark.parametrize("kind", ["shared", "variance"])
def test_the_output_axes_are_ordered_and_keep_full_length_cosines(kind: str) -> None:
    from model.evaluate import embed
    from model.train import set_output_axes
    from model.transformer import Encoder, EncoderConfig

    torch.manual_seed(0)
    model = Encoder(EncoderConfig(vocab_size=50, max_len=16, d_model=16, n_heads=2, n_layers=1, d_ff=32,
                                  dropout=0.0, output_rotation=True)).eval()  # fmt: skip
    rows = [list(np.random.default_rng(i).integers(1, 50, size=2 + i % 9)) for i in range(600)]
    anchors, positives = rows[:300], [row[: max(2, len(row) - 1)] for row in rows[:300]]  # matches: one token less
    before = embed(model, rows, pad=0)
    set_output_axes(model, anchors, positives, pad=0, kind=kind)
    after = embed(model, rows, pad=0)
    rotation = model.rotation.numpy()  # type: ignore[union-attr]
    assert np.allclose(rotation @ rotation.T, np.eye(16), atol=1e-5)  # orthogonal
    assert np.allclose(after @ after.T, before @ before.T, atol=1e-5)  # every full-length cosine kept
    a, p = embed(model, anchors, pad=0), embed(model, positives, pad=0)
    both = np.concatenate([a, p])
    a, p = np.split(both - both.mean(axis=0), 2)
    per_axis = (a * p).mean(axis=0) if kind == "shared" else both.var(axis=0)  # what each kind orders by
    assert np.all(np.diff(per_axis) <= 1e-6) and per_axis[0] > 2 * abs(per_axis[-1])  # first axes carry the most
    assert not np.allclose(after, before, atol=1e-3)  # and it did turn them


def test_shared_axes_put_what_matched_texts_share_ahead_of_larger_noise() -> None:
    from model.train import output_axes

    rng = np.random.default_rng(0)
    n = 4000
    shared = rng.normal(0, 1.0, n)  # the same in a text and its match
    anchors = np.stack([shared, rng.normal(0, 3.0, n), rng.normal(0, 0.1, n)], axis=1)  # axis 1: larger, unshared
    positives = np.stack([shared, rng.normal(0, 3.0, n), rng.normal(0, 0.1, n)], axis=1)
    turn, _ = np.linalg.qr(rng.normal(size=(3, 3)))  # hide the axes behind a random rotation
    a, p = (anchors @ turn).astype(np.float32), (positives @ turn).astype(np.float32)
    by_sharing, by_variance = output_axes(a, p, "shared"), output_axes(a, p, "variance")
    assert abs(turn[0] @ by_sharing[:, 0]) > 0.99  # shared: the common direction first
    assert abs(turn[1] @ by_variance[:, 0]) > 0.99  # variance: the noise, which varies most
    assert np.allclose(by_sharing.T @ by_sharing, np.eye(3), atol=1e-5)
    with pytest.raises(ValueError, match="kind"):
        output_axes(a, p, "none")  # none is no axes at all: training leaves the rotation out


def test_the_prefix_ranking_loss_pulls_each_prefix_towards_the_full_lengths_ranking() -> None:
    from model.losses import prefix_ranking_loss

    a, b = torch.randn(8, 32), torch.randn(8, 32)
    assert float(prefix_ranking_loss(a, b, (), 0.05)) == 0.0
    assert float(prefix_ranking_loss(a, b, (16,), 0.05)) > 0.01  # a random prefix ranks otherwise
    carried = torch.cat([a[:, :16], torch.zeros(8, 16)], dim=1), torch.cat([b[:, :16], torch.zeros(8, 16)], dim=1)
    assert float(prefix_ranking_loss(*carried, (16,), 0.05)) == pytest.approx(0.0, abs=1e-5)  # the prefix is it all
    off = train(tiny_train_config())
    on = train(tiny_train_config(prefix_ranking_weight=1.0))
    assert on.losses != off.losses  # in the gradient when weighted, and off by default
    nowhere = train(tiny_train_config(prefix_ranking_weight=1.0, prefix_ranking_dims=()))
    assert nowhere.losses == off.losses  # on no prefix: nothing added


def test_train_without_wordnet_says_how_to_get_it(tmp_path: Path) -> None:
    from model.train import main

    with pytest.raises(SystemExit) as exited:
        main(["--wordnet-dir", str(tmp_path), "--out-dir", str(tmp_path / "out"), "--teacher", "none"])
    assert "wordnet-base" in str(exited.value.code)
