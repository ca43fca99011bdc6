from __future__ import annotations

from pathlib import Path

import pytest
import torch

import model.checkpoint
from model.checkpoint import CHECKPOINT, load_checkpoint, save_checkpoint
from model.tokenizer import train_tokenizer
from model.transformer import Encoder, EncoderConfig
from tests.conftest import TINY_MODEL

TEXTS = ["a small domesticated carnivore", "draw air into the lungs", "a large natural stream of water"] * 20


def test_a_checkpoint_reads_back_as_saved(tmp_path: Path) -> None:
    encoder = Encoder(EncoderConfig(**TINY_MODEL))
    path = save_checkpoint(encoder, train_tokenizer(TEXTS, 200, 32), {"steps": 3}, tmp_path)
    loaded, summary = load_checkpoint(path)
    assert summary == {"steps": 3} and (tmp_path / "tokenizer.json").is_file()
    for name, tensor in encoder.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_a_save_stopped_part_way_leaves_no_checkpoint_beside_the_new_tokenizer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`make` takes checkpoint.pt for a finished training: a run stopped while saving must leave none, neither a
    file cut short nor the last run's checkpoint beside this run's tokenizer."""
    save_checkpoint(Encoder(EncoderConfig(**TINY_MODEL)), train_tokenizer(TEXTS, 200, 32), {"run": 1}, tmp_path)
    real_save = torch.save

    def interrupted_save(obj: object, file: object) -> None:  # Ctrl-C half-way through the write
        real_save(obj, file)
        Path(str(file)).write_bytes(Path(str(file)).read_bytes()[:100])
        raise KeyboardInterrupt

    monkeypatch.setattr(model.checkpoint.torch, "save", interrupted_save)
    second = Encoder(EncoderConfig(**{**TINY_MODEL, "d_model": 16}))
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(second, train_tokenizer(TEXTS, 150, 32), {"run": 2}, tmp_path)
    assert not (tmp_path / CHECKPOINT).exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(CHECKPOINT)] == []
