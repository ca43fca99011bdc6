"""Shared fixtures: one tiny model trained for a few steps on a slice of WordNet and exported, per run."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

TINY_MODEL = dict(vocab_size=1000, max_len=32, d_model=32, n_heads=2, n_layers=2, d_ff=64, dropout=0.1)


@pytest.fixture(scope="session")
def tiny_training(tmp_path_factory: pytest.TempPathFactory):
    from model.train import TrainConfig, save_checkpoint, train
    from model.transformer import EncoderConfig

    config = replace(
        TrainConfig(progress=False),
        steps=12,
        batch_size=32,
        vocab_size=1000,
        max_synsets=3000,
        held_out_fraction=0.05,
        model=EncoderConfig(**TINY_MODEL),
    )
    result = train(config)
    out = tmp_path_factory.mktemp("tiny")
    save_checkpoint(result, out)
    return result, out


@pytest.fixture(scope="session")
def tiny_artifacts(tiny_training) -> Path:
    """A model directory with every serving artifact, produced by the real export path."""
    from export.artifacts import export_all

    _, out = tiny_training
    _, report = export_all(out)
    assert report.passes(), report.table()
    return out
