"""Held-out evaluation of an encoder: WordNet retrieval (recall@1, recall@10, MRR) for the model, its
shortened prefixes, a TF-IDF baseline and a reference model (whole and cut to the same fractions of its
width), and the outside-WordNet check; plus the model's size and the table `make train` prints.

For each held-out example sentence, every held-out definition is ranked by cosine similarity; the
target is the sentence's own synset's definition. Each scored row keeps its queries' ranks, so that a
comparison between two rows (a prefix against the full length, against the teacher) gets an interval
from resampling the held-out synsets: a split of 990 queries moves a recall by about 0.01.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from contract.manifest import Manifest
from model.checkpoint import encode_texts
from model.data import Synset
from model.distill import flops_per_token, teacher_embeddings
from model.tokenizer import pad_id
from model.transformer import Encoder, EncoderConfig


@dataclass(frozen=True)
class RetrievalScores:
    recall_at_1: float
    recall_at_10: float
    mrr: float


def pad_batch(rows: Sequence[Sequence[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad token id lists to the longest row. Returns input_ids and attention_mask, (B, T) int64."""
    lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    mask = np.arange(lengths.max()) < lengths[:, None]  # (B, T): True where a row has a token
    ids = np.full(mask.shape, pad, dtype=np.int64)
    ids[mask] = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64, count=int(lengths.sum()))
    return torch.from_numpy(ids), torch.from_numpy(mask.astype(np.int64))


@torch.no_grad()
def embed(
    model: Encoder, rows: Sequence[Sequence[int]], pad: int, batch_size: int = 256, dims: int | None = None
) -> np.ndarray:
    """L2-normalised embeddings of token id rows, in order; with ``dims``, of their first ``dims``
    components (cut, then normalised, as the server shortens them). Sorting by length keeps padding low."""
    model.eval()
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
    out = np.zeros((len(rows), dims or model.d_model), dtype=np.float32)
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        ids, mask = pad_batch([rows[i] for i in chunk], pad)
        out[chunk] = F.normalize(model(ids, mask)[:, : dims or model.d_model], dim=-1).numpy()
    return out


def shortened(vectors: np.ndarray, dims: int) -> np.ndarray:
    """The first ``dims`` components of each row, re-normalised."""
    cut = vectors[:, :dims]
    return cut / np.maximum(np.linalg.norm(cut, axis=1, keepdims=True), 1e-12)


def retrieval_ranks(queries: np.ndarray, docs: np.ndarray, targets: Sequence[int]) -> np.ndarray:
    """queries (Q, D) and docs (N, D) L2-normalised; targets[q] is the index of q's correct doc."""
    return query_ranks(queries @ docs.T, targets)


def query_ranks(sims: np.ndarray, targets: Sequence[int]) -> np.ndarray:
    """(Q,) each query's correct doc's rank, 1 = best; ties count in the query's favour. sims (Q, N): each
    query's similarity to every doc; targets[q] is the index of q's correct doc."""
    target_sims = sims[np.arange(len(targets)), targets]
    return (sims > target_sims[:, None]).sum(axis=1) + 1


def scores_of(ranks: np.ndarray) -> RetrievalScores:
    return RetrievalScores(
        recall_at_1=float(np.mean(ranks <= 1)),
        recall_at_10=float(np.mean(ranks <= 10)),
        mrr=float(np.mean(1.0 / ranks)),
    )


@dataclass(frozen=True)
class HeldOutTask:
    queries: list[str]  # held-out example sentences
    docs: list[str]  # held-out definitions, one per held-out synset
    targets: list[int]  # index into docs of each query's definition


def held_out_task(held_out: Sequence[Synset]) -> HeldOutTask:
    queries, targets = [], []
    for i, s in enumerate(held_out):
        for example in s.examples:
            queries.append(example)
            targets.append(i)
    return HeldOutTask(queries, [s.definition for s in held_out], targets)


@dataclass(frozen=True)
class Interval:
    value: float  # on the held-out queries as they are
    low: float  # the 2.5th and 97.5th percentiles over resampled held-out synsets
    high: float


def synset_bootstrap(
    measures: np.ndarray,
    groups: Sequence[int],
    statistic: Callable[[np.ndarray], np.ndarray],
    resamples: int = 2000,
    seed: int = 0,
) -> Interval:
    """A 95% interval for ``statistic`` of per-query ``measures`` (Q, K), resampling whole groups (a query's
    target synset: the examples of one synset rise and fall together) with replacement. ``statistic`` maps
    (R, K) means, one row per resample, to (R,); both rows of a comparison come from the same resample."""
    _, group_of = np.unique(np.asarray(groups), return_inverse=True)
    count = int(group_of.max()) + 1
    sums = np.zeros((count, measures.shape[1]))  # (G, K)
    np.add.at(sums, group_of, measures)
    sizes = np.bincount(group_of, minlength=count).astype(np.float64)  # (G,)
    weights = np.random.default_rng(seed).multinomial(count, np.full(count, 1 / count), size=resamples)  # (R, G)
    values = statistic((weights @ sums) / (weights @ sizes)[:, None])
    low, high = np.percentile(values, [2.5, 97.5])
    return Interval(float(statistic((sums.sum(0) / sizes.sum())[None])[0]), float(low), float(high))


def prefix_comparisons(
    ranks: dict[str, np.ndarray], task: HeldOutTask, dims: Sequence[int], resamples: int = 2000
) -> dict[str, dict[str, float]]:
    """With intervals over resampled held-out synsets: each trained prefix's recall@10 as a share of the full
    length's and, with a teacher row, its recall@1 minus the teacher's at full length."""

    def compared(one: np.ndarray, other: np.ndarray, statistic: Callable[[np.ndarray], np.ndarray]) -> dict[str, float]:
        both = np.stack([one, other], axis=1).astype(np.float64)  # (Q, 2): the two sides, query by query
        return asdict(synset_bootstrap(both, task.targets, statistic, resamples))

    comparisons: dict[str, dict[str, float]] = {}
    for d in dims:
        prefix, full = ranks[f"trained @{d}"], ranks["trained"]
        share = compared(prefix <= 10, full <= 10, lambda m: m[:, 0] / np.maximum(m[:, 1], 1e-12))
        comparisons[f"trained @{d} recall@10 / trained"] = share
        if "teacher" in ranks:
            gap = compared(prefix <= 1, ranks["teacher"] <= 1, lambda m: m[:, 0] - m[:, 1])
            comparisons[f"trained @{d} recall@1 - teacher"] = gap
    return comparisons


def tfidf_ranks(task: HeldOutTask, fit_texts: Sequence[str]) -> np.ndarray:
    from sklearn.feature_extraction.text import TfidfVectorizer

    vectorizer = TfidfVectorizer(lowercase=True, sublinear_tf=True).fit(fit_texts)
    q = vectorizer.transform(task.queries).astype(np.float32)  # sparse rows, L2-normalised by the vectorizer
    d = vectorizer.transform(task.docs).astype(np.float32)
    return query_ranks((q @ d.T).toarray(), task.targets)  # dense rows over the vocabulary would take GBs


def model_ranks(model: Encoder, tokenizer: Tokenizer, task: HeldOutTask, dims: int | None = None) -> np.ndarray:
    pad = pad_id(tokenizer)
    max_len = model.max_len
    q = embed(model, encode_texts(tokenizer, task.queries, max_len), pad, dims=dims)
    d = embed(model, encode_texts(tokenizer, task.docs, max_len), pad, dims=dims)
    return retrieval_ranks(q, d, task.targets)


def reference_embedder(reference: Path, max_len: int, cache_dir: Path) -> Callable[[Sequence[str]], np.ndarray]:
    """The reference model's embeddings as it is served (fp32, its full max length), cached for repeat runs."""
    return lambda texts: teacher_embeddings(reference, texts, cache_dir, max_len, "fp32", "float32")[0]


def teacher_ranks(embed_texts: Callable[[Sequence[str]], np.ndarray], task: HeldOutTask) -> np.ndarray:
    """The teacher on the same held-out task."""
    return retrieval_ranks(embed_texts(task.queries), embed_texts(task.docs), task.targets)


@dataclass(frozen=True)
class Outside:
    """The outside-WordNet check's size: standard-library sentences, pairs of them scored, and the seed."""

    sentences: int
    pairs: int
    seed: int


def outside_wordnet(
    model: Encoder, tokenizer: Tokenizer, reference: Callable[[Sequence[str]], np.ndarray], outside: Outside
) -> dict[str, object]:
    """Spearman between the student's and the reference's cosine similarities on standard-library sentences."""
    from model.outside import similarity_agreement, stdlib_sentences

    sentences = stdlib_sentences(outside.sentences, outside.seed)
    spearman = similarity_agreement(
        lambda texts: embed(model, encode_texts(tokenizer, texts, model.max_len), pad_id(tokenizer)),
        reference,
        sentences,
        outside.pairs,
        outside.seed,
    )
    return {"sentences": len(sentences), "pairs": outside.pairs, "spearman": spearman}


def held_out_ranks(
    model: Encoder, tokenizer: Tokenizer, task: HeldOutTask, fit_texts: Sequence[str], dims: Sequence[int]
) -> dict[str, np.ndarray]:
    """Each query's rank under TF-IDF (fit on ``fit_texts``), the trained model, and each of its prefixes of
    ``dims`` on its own (scores_of turns a row into its scores)."""
    ranks = {"tfidf": tfidf_ranks(task, fit_texts), "trained": model_ranks(model, tokenizer, task)}
    for d in dims:
        ranks[f"trained @{d}"] = model_ranks(model, tokenizer, task, dims=d)
    return ranks


def evaluate_reference(
    reference: Path,
    model: Encoder,
    tokenizer: Tokenizer,
    task: HeldOutTask,
    dims: Sequence[int],
    cache_dir: Path,
    outside: Outside,
) -> tuple[dict[str, np.ndarray], dict[str, int], dict[str, object]]:
    """An exported reference model (the teacher) on the same task, whole and cut to the same fractions of its
    width as ``dims`` are of the model's (each query's rank); its size; and the model's agreement with it
    outside WordNet."""
    manifest = Manifest.read(reference)
    reference_embeddings = reference_embedder(reference, manifest.max_length, cache_dir)
    ranks = {"teacher": teacher_ranks(reference_embeddings, task)}
    for d in dims:
        cut = manifest.dim * d // model.d_model

        def cut_embeddings(texts: Sequence[str], cut: int = cut) -> np.ndarray:
            return shortened(reference_embeddings(texts), cut)

        ranks[f"teacher @{cut}"] = teacher_ranks(cut_embeddings, task)
    agreement = {"reference": manifest.model_id, **outside_wordnet(model, tokenizer, reference_embeddings, outside)}
    return ranks, model_size(EncoderConfig(**manifest.config)), agreement


def model_size(config: EncoderConfig) -> dict[str, int]:
    """Parameters and forward matmul FLOPs per token (model/distill.py's count) of an encoder configuration."""
    parameters = sum(p.numel() for p in Encoder(config).parameters())
    return {"parameters": parameters, "flops_per_token": flops_per_token(config.n_layers, config.d_model, config.d_ff)}


def format_evaluation(evaluation: dict[str, dict[str, float]], sizes: dict[str, dict[str, int]] | None = None) -> str:
    sizes = sizes or {}
    lines = ["| model | parameters | MFLOP/token | recall@1 | recall@10 | MRR |", "|---|---:|---:|---:|---:|---:|"]
    for name, scores in evaluation.items():
        size = sizes.get(name)
        params = f"{size['parameters'] / 1e6:.2f} M" if size else ""
        flops = f"{size['flops_per_token'] / 1e6:.2f}" if size else ""
        lines.append(
            f"| {name} | {params} | {flops} | {scores['recall_at_1']:.3f} | {scores['recall_at_10']:.3f} | "
            f"{scores['mrr']:.3f} |"
        )
    return "\n".join(lines)


def format_comparisons(comparisons: dict[str, dict[str, float]]) -> str:
    """One line a comparison: its value on the held-out queries and its 95% interval over resampled synsets."""
    lines = []
    for name, c in comparisons.items():
        form = "{:+.3f}" if "teacher" in name else "{:.1%}"  # a difference of recalls, or a share of one
        value, low, high = (form.format(c[k]) for k in ("value", "low", "high"))
        lines.append(f"{name}: {value} (95% interval {low} to {high} over resampled held-out synsets)")
    return "\n".join(lines)
