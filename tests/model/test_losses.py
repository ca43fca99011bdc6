from __future__ import annotations

import numpy as np
import pytest
import torch

from model.losses import cosine_matrix, info_nce, projection_loss, similarity_matching_loss


def test_info_nce_rewards_matching_rows() -> None:
    torch.manual_seed(0)
    a = torch.randn(16, 8)
    matched = info_nce(a, a + 0.01 * torch.randn(16, 8), temperature=0.05)
    shuffled = info_nce(a, a[torch.randperm(16)], temperature=0.05)
    assert matched.item() < 0.1 < np.log(16) < shuffled.item() + 1


def test_similarity_matching_ignores_width_and_sees_structure() -> None:
    torch.manual_seed(0)
    teacher = torch.randn(12, 8)
    same_structure = torch.cat([teacher, torch.zeros(12, 4)], dim=1)  # another width, same cosines
    assert similarity_matching_loss(same_structure, cosine_matrix(teacher)).item() == pytest.approx(0.0, abs=1e-7)
    shuffled = same_structure[torch.randperm(12)]
    assert similarity_matching_loss(shuffled, cosine_matrix(teacher)).item() > 0.05


def test_projection_loss_is_cosine_to_the_teacher() -> None:
    torch.manual_seed(0)
    teacher = torch.randn(6, 8)
    assert projection_loss(3 * teacher, teacher).item() == pytest.approx(0.0, abs=1e-6)  # scale does not matter
    assert projection_loss(-teacher, teacher).item() == pytest.approx(2.0, abs=1e-6)
