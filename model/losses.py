"""The training objective's terms, each on a batch of embeddings: contrastive (InfoNCE at full length and on
each nested prefix, the prefixes' rankings against the full length's) and distillation (the teacher's
similarity structure, or its coordinates through a projection). model/train.py weighs them into a step's loss.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def info_nce(a: torch.Tensor, b: torch.Tensor, temperature: float) -> torch.Tensor:
    """Symmetric InfoNCE: row i of a matches row i of b; all other rows are negatives. a, b: (B, C)."""
    a, b = F.normalize(a, dim=-1), F.normalize(b, dim=-1)
    logits = a @ b.T / temperature  # (B, B)
    target = torch.arange(a.size(0))
    return (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target)) / 2


def matryoshka_loss(a: torch.Tensor, b: torch.Tensor, dims: Sequence[int], temperature: float) -> torch.Tensor:
    """InfoNCE on each nested prefix of the embeddings (Matryoshka representation learning): the first
    d components must rank the pairs on their own. a, b: (B, C); dims all < C. Zero when dims is empty."""
    losses = [info_nce(a[:, :d], b[:, :d], temperature) for d in dims]  # each on (B, d)
    return torch.stack(losses).sum() if losses else a.new_zeros(())


def prefix_ranking_loss(a: torch.Tensor, b: torch.Tensor, dims: Sequence[int], temperature: float) -> torch.Tensor:
    """Each prefix's in-batch ranking pulled towards the full length's (held fixed): KL divergence between
    the softmax over a row's candidates at full length and at the first d components, both directions.
    a, b: (B, C); zero when dims is empty."""
    a, b = F.normalize(a, dim=-1), F.normalize(b, dim=-1)
    full = (a @ b.T / temperature).detach()  # (B, B)
    losses = []
    for d in dims:
        ad, bd = F.normalize(a[:, :d], dim=-1), F.normalize(b[:, :d], dim=-1)
        short = ad @ bd.T / temperature  # (B, B)
        for target, logits in ((full, short), (full.T, short.T)):
            losses.append(
                F.kl_div(F.log_softmax(logits, -1), F.log_softmax(target, -1), reduction="batchmean", log_target=True)
            )
    return torch.stack(losses).sum() / 2 if losses else a.new_zeros(())


def cosine_matrix(rows: torch.Tensor) -> torch.Tensor:
    """(N, N): the cosine similarity of every pair of rows of (N, D)."""
    unit = F.normalize(rows, dim=-1)
    return unit @ unit.T


def similarity_matching_loss(student: torch.Tensor, teacher_cosines: torch.Tensor) -> torch.Tensor:
    """MSE between the cosine-similarity matrix of the student's rows, (N, C), and the teacher's,
    cosine_matrix of its (N, D) rows: computed once per batch for the full length and every prefix."""
    return F.mse_loss(cosine_matrix(student), teacher_cosines)


def projection_loss(projected: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """1 - cosine between the student's rows mapped to the teacher's width and the teacher's. (N, D) each."""
    return (1 - F.cosine_similarity(projected, teacher, dim=-1)).mean()
