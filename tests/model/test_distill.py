from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from model.distill import flops_per_token, projection_loss, similarity_matching_loss
from model.train import TrainConfig, resolve_teacher, train
from tests.conftest import tiny_train_config


def test_similarity_matching_ignores_width_and_sees_structure() -> None:
    torch.manual_seed(0)
    teacher = torch.randn(12, 8)
    same_structure = torch.cat([teacher, torch.zeros(12, 4)], dim=1)  # another width, same cosines
    assert similarity_matching_loss(same_structure, teacher).item() == pytest.approx(0.0, abs=1e-7)
    shuffled = same_structure[torch.randperm(12)]
    assert similarity_matching_loss(shuffled, teacher).item() > 0.05


def test_projection_loss_is_cosine_to_the_teacher() -> None:
    torch.manual_seed(0)
    teacher = torch.randn(6, 8)
    assert projection_loss(3 * teacher, teacher).item() == pytest.approx(0.0, abs=1e-6)  # scale does not matter
    assert projection_loss(-teacher, teacher).item() == pytest.approx(2.0, abs=1e-6)


def test_flops_per_token_of_minilm() -> None:
    # all-MiniLM-L6-v2: 6 layers, d 384, d_ff 1536 -> 2 x 6 x (4 x 384^2 + 2 x 384 x 1536)
    assert flops_per_token(6, 384, 1536) == 2 * 6 * (589_824 + 1_179_648) == 21_233_664


def tiny_config(out_dir: Path, teacher_dir: str = "") -> TrainConfig:
    return tiny_train_config(out_dir=str(out_dir), teacher_dir=teacher_dir, outside_sentences=200, outside_pairs=500)


def test_distillation_caches_the_teacher_and_changes_the_objective(tiny_bert_artifacts: Path, tmp_path: Path) -> None:
    config = tiny_config(tmp_path, str(tiny_bert_artifacts))
    first = train(config)
    assert first.summary["teacher"] == "test/tiny-bert" and first.summary["teacher_cache"] == "computed"
    assert list((tmp_path / "teacher-cache").glob("teacher-*.npy"))
    second = train(config)
    assert second.summary["teacher_cache"] == "hit"
    assert second.losses == first.losses  # the cache gives the teacher exactly as first used
    assert set(first.evaluation) == {"untrained", "tfidf", "trained", "teacher"}
    outside = first.summary["outside_wordnet"]
    assert outside["reference"] == "test/tiny-bert" and outside["pairs"] == 500 and -1 <= outside["spearman"] <= 1
    plain = train(tiny_config(tmp_path))
    assert "teacher" not in plain.summary and plain.losses != first.losses
    matched = train(replace(config, distill_weight=1.0))
    projected = train(replace(config, distill_loss="projection", distill_weight=1.0))
    assert projected.losses != matched.losses and projected.summary["distill_loss"] == "projection"
    # The head that maps the student to the teacher's width is for training only: the model is the plain encoder.
    assert projected.model.state_dict().keys() == plain.model.state_dict().keys()


def test_an_unknown_distillation_loss_is_refused() -> None:
    with pytest.raises(ValueError, match="distill_loss must be one of"):
        TrainConfig(distill_loss="kl")


def test_teacher_choice(tmp_path: Path) -> None:
    assert resolve_teacher("none", tmp_path) == ""
    with pytest.raises(SystemExit, match="no exported model there"):
        resolve_teacher(str(tmp_path / "nowhere"), tmp_path)
