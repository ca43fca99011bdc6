"""Brief contrastive training of the encoder on WordNet, then its held-out evaluation and the checkpoint.

Objective: symmetric InfoNCE with in-batch negatives on positive pairs (example sentence <-> its
definition, lemma set <-> its definition). Evaluation (model/evaluate.py): for each held-out example
sentence, rank all held-out definitions by cosine similarity; recall@1, recall@10 and MRR for the
untrained model, a TF-IDF baseline, the trained model and each trained prefix, and the reference model.

    python -m model.train [--steps N] [--out-dir artifacts] [--wordnet-dir /usr/share/wordnet]
    python -m model.train --teacher artifacts/minilm   # distilled: see model/distill.py and Recipe
"""

from __future__ import annotations

import argparse
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer
from tqdm import tqdm

from contract.manifest import MANIFEST_FILE, Manifest
from model.checkpoint import encode_texts, save_checkpoint
from model.data import DEFAULT_WORDNET_DIR, WordNetNotFound, read_wordnet, split_synsets, training_side
from model.data import synset_distinct_batches as make_batches
from model.distill import teacher_embeddings, teacher_token_init, token_strings
from model.evaluate import (
    Outside,
    embed,
    evaluate_reference,
    format_comparisons,
    format_evaluation,
    held_out_ranks,
    held_out_task,
    model_ranks,
    model_size,
    pad_batch,
    prefix_comparisons,
    scores_of,
)
from model.losses import (
    cosine_matrix,
    info_nce,
    matryoshka_loss,
    prefix_ranking_loss,
    projection_loss,
    similarity_matching_loss,
)
from model.tokenizer import pad_id, train_tokenizer
from model.transformer import Encoder, EncoderConfig

DISTILL_LOSSES = ("similarity", "projection")
OUTPUT_AXES = ("shared", "variance", "none")


@dataclass(frozen=True)
class Recipe:
    """Defaults that differ with the starting point, each measured (docs/model.md)."""

    steps: int  # sized to the time budget on 2 cores
    vocab_size: int
    matryoshka_weight: float  # of each prefix's losses (matryoshka_dims), against the full length's


PLAIN = Recipe(steps=1400, vocab_size=8192, matryoshka_weight=0.0)  # InfoNCE only, random token embeddings
# Token embeddings from the teacher; the prefixes' InfoNCE at 0.3, without the teacher's similarity on them
# (docs/decisions/0023; the settings tried: docs/model.md).
DISTILLED = Recipe(steps=2100, vocab_size=32768, matryoshka_weight=0.3)


@dataclass(frozen=True)
class TrainConfig:
    wordnet_dir: str = str(DEFAULT_WORDNET_DIR)
    out_dir: str = "artifacts"
    seed: int = 0
    steps: int | None = None  # optimizer steps; None = the recipe's (train_steps)
    batch_size: int = 256  # pairs per step; every other row of the batch is a negative
    lr: float = 3e-3  # peak AdamW learning rate
    warmup_steps: int = 50  # linear warm-up, then cosine decay to 0
    weight_decay: float = 0.01
    temperature: float = 0.05  # InfoNCE softmax temperature on cosine similarities
    train_max_len: int = 32  # texts are truncated to this many tokens during training only
    vocab_size: int | None = None  # WordPiece tokens; None = the recipe's (vocabulary)
    held_out_fraction: float = 0.02  # share of synsets never trained on, split by synset
    max_synsets: int = 0  # 0 = all; tests use a slice to build a tiny model fast
    threads: int = 0  # torch intra-op threads; 0 = torch's default (all cores)
    bf16: str = "auto"  # bf16 autocast for the forward pass: auto (where the CPU has bf16 units) | on | off
    progress: bool = True
    teacher_dir: str = ""  # an exported teacher (make export-pretrained) to distil from; "" = InfoNCE only
    distill_weight: float = 30.0  # of the distillation loss next to InfoNCE; 3, 10, 30, 100 measured (docs/model.md)
    # similarity: match the in-batch cosine matrices | projection: cosine to the teacher through a linear head
    distill_loss: str = "similarity"
    teacher_init: bool = True  # start the student's token embeddings from the teacher's (PCA of each token alone)
    # Shortened lengths evaluated and recorded in the manifest. With a prefix weight > 0 each is also
    # trained to stand alone (Matryoshka): InfoNCE on each prefix, beside the full length.
    matryoshka_dims: tuple[int, ...] = (32, 64)
    matryoshka_weight: float | None = None  # of each prefix's losses; None = the recipe's (prefix_weight)
    # With a teacher, the similarity-matching loss on each prefix too (else on the full length only, the prefixes
    # trained by InfoNCE alone: 64 components keep more of the full length's recall, docs/decisions/0023).
    matryoshka_distill: bool = False
    prefix_ranking_weight: float = 0.0  # of each prefix's ranking matched to the full length's (prefix_ranking_loss)
    prefix_ranking_dims: tuple[int, ...] | None = None  # the prefixes it applies to; None = matryoshka_dims
    # After training, the output's axes are turned (a rotation: full-length cosines do not change) so that the first
    # components carry the most of what training texts and their matches share (shared, output_axes) or the most
    # variance (variance: principal axes); none leaves them as trained. Shared kept more at 32 and 64 components
    # on four held-out splits (docs/decisions/0024).
    output_axes: str = "shared"
    rotation_texts: int = 20_000  # training texts (anchors and positives) the axes are computed from
    # An exported reference model for the evaluation only: its own held-out row and the outside-WordNet check.
    reference_dir: str = ""
    outside_sentences: int = 3000  # standard-library docstring lines for the outside-WordNet check
    outside_pairs: int = 5000
    # Dropout off: a brief run sees each pair about once, so there is nothing to overfit yet.
    model: EncoderConfig = field(default_factory=lambda: EncoderConfig(dropout=0.0))

    def __post_init__(self) -> None:
        if any(not 0 < d < self.model.d_model for d in self.matryoshka_dims):
            raise ValueError(f"matryoshka_dims must lie between 0 and d_model ({self.model.d_model})")
        if self.output_axes not in OUTPUT_AXES:
            raise ValueError(f"output_axes must be one of {OUTPUT_AXES}, not {self.output_axes!r}")
        if self.distill_loss not in DISTILL_LOSSES:
            raise ValueError(f"distill_loss must be one of {DISTILL_LOSSES}, not {self.distill_loss!r}")

    @property
    def recipe(self) -> Recipe:
        """A large vocabulary pays only when its rows start from the teacher's: with random rows most tokens
        are seen too rarely in a brief run to learn. With the teacher, twice the steps make room for the prefix
        losses (docs/model.md)."""
        return DISTILLED if self.teacher_dir and self.teacher_init else PLAIN

    @property
    def train_steps(self) -> int:
        return self.recipe.steps if self.steps is None else self.steps

    @property
    def prefix_weight(self) -> float:
        return self.recipe.matryoshka_weight if self.matryoshka_weight is None else self.matryoshka_weight

    @property
    def vocabulary(self) -> int:
        return self.recipe.vocab_size if self.vocab_size is None else self.vocab_size


def cpu_has_fast_bf16() -> bool:
    """AVX512-BF16 or AMX units make bf16 matmuls about twice as fast as fp32 on the CPU."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def use_bf16(setting: str) -> bool:
    return setting == "on" or (setting == "auto" and cpu_has_fast_bf16())


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def output_axes(anchors: np.ndarray, positives: np.ndarray, kind: str) -> np.ndarray:
    """(C, C) orthogonal, column k the k-th output axis, from the normalised embeddings of matched texts (N, C) each.

    variance: the principal axes of all 2N rows, by variance. shared: the eigenvectors of the anchors' and
    positives' cross-covariance (symmetrised), by eigenvalue: the directions along which a text and its match move
    together come first, those along which they differ (noise to a search) last, however much they vary."""
    both = np.concatenate([anchors, positives])  # (2N, C)
    if kind == "variance":
        _, _, vt = np.linalg.svd(both - both.mean(axis=0), full_matrices=False)  # vt: (C, C), rows by variance
        return vt.T.copy()
    if kind != "shared":
        raise ValueError(f"no output axes of kind {kind!r}")
    both = both.astype(np.float64)
    a, p = np.split(both - both.mean(axis=0), 2)  # (N, C) each, centred on the mean of both
    shared = (a.T @ p + p.T @ a) / (2 * len(a))  # (C, C), symmetric: its eigenvectors are orthogonal
    values, vectors = np.linalg.eigh(shared)
    return vectors[:, np.argsort(values)[::-1]].astype(np.float32)


def set_output_axes(
    model: Encoder, anchors: Sequence[Sequence[int]], positives: Sequence[Sequence[int]], pad: int, kind: str
) -> None:
    """Turns the output's axes to output_axes(kind) of these matched rows' embeddings."""
    rotation = model.rotation
    assert isinstance(rotation, torch.Tensor), "the model was built without output_rotation"
    with torch.no_grad():
        rotation.copy_(torch.eye(model.d_model))
        a, p = embed(model, anchors, pad), embed(model, positives, pad)  # (N, C) each, in the pooled axes
        rotation.copy_(torch.from_numpy(output_axes(a, p, kind)))  # pooled (B, C) @ (C, C): component k on axis k


def step_loss(
    config: TrainConfig,
    a: torch.Tensor,
    p: torch.Tensor,
    targets: torch.Tensor | None = None,
    head: torch.nn.Linear | None = None,
) -> torch.Tensor:
    """One step's objective, weighted by the config, on the embeddings of the anchors and of their positives
    (a, p: (B, C)): InfoNCE at full length, on each prefix and the prefixes' rankings; with a teacher (targets:
    its rows of the anchors then the positives, (2B, D)), its similarity structure or, through head, its
    coordinates."""
    prefix_dims = config.matryoshka_dims if config.prefix_weight else ()  # at weight 0 only evaluated, not trained
    loss = info_nce(a.float(), p.float(), config.temperature)
    prefixes = matryoshka_loss(a.float(), p.float(), prefix_dims, config.temperature)
    loss = loss + config.prefix_weight * prefixes
    if config.prefix_ranking_weight:
        dims = config.matryoshka_dims if config.prefix_ranking_dims is None else config.prefix_ranking_dims
        ranking = prefix_ranking_loss(a.float(), p.float(), dims, config.temperature)
        loss = loss + config.prefix_ranking_weight * ranking
    if targets is None:
        return loss
    student = torch.cat([a, p]).float()  # (2B, C)
    if head is not None:
        return loss + config.distill_weight * projection_loss(head(student), targets)
    target_cosines = cosine_matrix(targets)  # (2B, 2B), the same for every prefix
    loss = loss + config.distill_weight * similarity_matching_loss(student, target_cosines)
    if config.matryoshka_distill:
        for d in prefix_dims:
            matched = similarity_matching_loss(student[:, :d], target_cosines)
            loss = loss + config.distill_weight * config.prefix_weight * matched
    return loss


def lr_at(step: int, config: TrainConfig) -> float:
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.train_steps - config.warmup_steps)
    return config.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


@dataclass
class TrainResult:
    model: Encoder
    tokenizer: Tokenizer
    losses: list[float]
    evaluation: dict[str, dict[str, float]]
    summary: dict[str, object]


def train(config: TrainConfig, on_step: Callable[[int, float], None] | None = None) -> TrainResult:
    started = time.perf_counter()

    def say(what: str) -> None:  # the steps without a progress bar still say what runs, and since when
        if config.progress:
            print(f"train [{time.perf_counter() - started:.0f} s]: {what}", flush=True)

    set_seed(config.seed)
    if config.threads:
        torch.set_num_threads(config.threads)
    synsets = read_wordnet(config.wordnet_dir)
    if config.max_synsets:
        synsets = synsets[: config.max_synsets]
    train_synsets, held_out = split_synsets(synsets, config.held_out_fraction, config.seed)
    pairs, train_corpus = training_side(train_synsets, held_out)
    say(f"{len(pairs):,} training pairs; WordPiece vocabulary of {config.vocabulary:,} tokens")
    tokenizer = train_tokenizer(train_corpus, config.vocabulary, config.model.max_len)
    say("the training pairs' token ids")
    model_config = replace(
        config.model,
        vocab_size=tokenizer.get_vocab_size(),
        pad_id=pad_id(tokenizer),
        output_rotation=config.output_axes != "none",
    )
    pad = model_config.pad_id

    anchors = encode_texts(tokenizer, [p.anchor for p in pairs], config.train_max_len)
    positives = encode_texts(tokenizer, [p.positive for p in pairs], config.train_max_len)
    index_of = {id(p): i for i, p in enumerate(pairs)}
    pair_length = {id(p): max(len(anchors[i]), len(positives[i])) for i, p in enumerate(pairs)}

    cache_dir = Path(config.out_dir) / "teacher-cache"
    teacher: torch.Tensor | None = None
    teacher_summary: dict[str, object] = {}
    if config.teacher_dir:
        texts = sorted({p.anchor for p in pairs} | {p.positive for p in pairs})
        say(f"the teacher's embeddings of {len(texts):,} training texts")
        embeddings, teacher_summary = teacher_embeddings(Path(config.teacher_dir), texts, cache_dir)
        row_of = {t: i for i, t in enumerate(texts)}
        teacher = torch.from_numpy(embeddings)
        teacher_rows = torch.tensor([[row_of[p.anchor], row_of[p.positive]] for p in pairs])  # (pairs, 2)

    model = Encoder(model_config)
    if config.teacher_dir and config.teacher_init:
        vocab = [token for token, _ in sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])]  # by id
        token_vectors, _ = teacher_embeddings(Path(config.teacher_dir), token_strings(vocab), cache_dir)
        init = torch.from_numpy(teacher_token_init(token_vectors, model_config.d_model))
        with torch.no_grad():
            model.token_embedding.weight.copy_(init)
            model.token_embedding.weight[pad].zero_()  # padding stays a zero row, as in the random initialisation
    bf16 = use_bf16(config.bf16)
    task = held_out_task(held_out)
    untrained = scores_of(model_ranks(model, tokenizer, task))
    parameters = list(model.parameters())
    head: torch.nn.Linear | None = None
    if teacher is not None and config.distill_loss == "projection":
        head = torch.nn.Linear(model_config.d_model, teacher.shape[1], bias=False)  # training only, not exported
        parameters += list(head.parameters())
    # fused: the whole update in one kernel, several times faster a step than foreach=True on the CPU; the same
    # algorithm, its sums in another order.
    optimizer = torch.optim.AdamW(parameters, lr=config.lr, weight_decay=config.weight_decay, fused=True)
    rng = random.Random(config.seed)
    batches: list[list[int]] = []
    losses: list[float] = []
    model.train()
    bar = tqdm(range(config.train_steps), desc="train", disable=not config.progress, unit="step", mininterval=1.0)
    for step in bar:
        if not batches:  # a new epoch: reshuffle into synset-distinct batches
            epoch = make_batches(pairs, config.batch_size, rng, length=lambda p: pair_length[id(p)])
            batches = [[index_of[id(p)] for p in b] for b in epoch]
            batches.reverse()
        batch = batches.pop()
        a_ids, a_mask = pad_batch([anchors[i] for i in batch], pad)
        p_ids, p_mask = pad_batch([positives[i] for i in batch], pad)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, config)
        # Mixed precision: weights, optimizer state and the loss stay fp32; matmuls run in bf16.
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            a, p = model(a_ids, a_mask), model(p_ids, p_mask)
        targets = None
        if teacher is not None:
            rows = teacher_rows[batch]  # (B, 2): the teacher's rows of each anchor and positive
            targets = teacher[torch.cat([rows[:, 0], rows[:, 1]])]  # (2B, D)
        loss = step_loss(config, a, p, targets, head)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimizer.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
        if on_step is not None:
            on_step(step, losses[-1])
    model.eval()
    if config.output_axes != "none":
        say(f"output axes ({config.output_axes}) from {config.rotation_texts:,} training texts")
        sample = random.Random(config.seed).sample(range(len(pairs)), min(len(pairs), config.rotation_texts // 2))
        set_output_axes(model, [anchors[i] for i in sample], [positives[i] for i in sample], pad, config.output_axes)

    say("held-out WordNet retrieval: trained, TF-IDF and each trained prefix")
    ranks = held_out_ranks(model, tokenizer, task, train_corpus, config.matryoshka_dims)
    sizes = {"trained": model_size(model.config)}
    outside: dict[str, object] = {}
    if config.reference_dir or config.teacher_dir:  # a teacher is the reference unless another is named
        reference = Path(config.reference_dir or config.teacher_dir)
        say(f"the same for {Manifest.read(reference).model_id}, whole and cut; the outside-WordNet check")
        reference_ranks, sizes["teacher"], outside = evaluate_reference(
            reference, model, tokenizer, task, config.matryoshka_dims, cache_dir,
            Outside(config.outside_sentences, config.outside_pairs, config.seed),
        )  # fmt: skip
        ranks |= reference_ranks
    evaluation = {"untrained": asdict(untrained)} | {name: asdict(scores_of(r)) for name, r in ranks.items()}
    summary: dict[str, object] = {
        "steps": config.train_steps,
        "batch_size": config.batch_size,
        "seed": config.seed,
        "bf16_autocast": bf16,
        "train_synsets": len(train_synsets),
        "held_out_synsets": len(held_out),
        "train_pairs": len(pairs),
        "held_out_queries": len(task.queries),
        "final_loss": float(np.mean(losses[-20:])) if losses else None,
        "train_seconds": round(time.perf_counter() - started, 1),
        "distill_weight": config.distill_weight if config.teacher_dir else 0.0,
        "distill_loss": config.distill_loss if config.teacher_dir else "",
        "teacher_init": bool(config.teacher_dir and config.teacher_init),
        "matryoshka_dims": [*config.matryoshka_dims, model.d_model],  # the trained lengths, full included
        "matryoshka_weight": config.prefix_weight,
        "matryoshka_distill": config.matryoshka_distill,
        "output_axes": config.output_axes,
        "vocab_size": tokenizer.get_vocab_size(),
        **teacher_summary,
        "outside_wordnet": outside,
        "model_sizes": sizes,
        "evaluation": evaluation,
        "prefix_comparisons": prefix_comparisons(ranks, task, config.matryoshka_dims),
    }
    return TrainResult(model, tokenizer, losses, evaluation, summary)


def plot_losses(losses: Sequence[float], path: Path | str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(losses, alpha=0.35, label="per step")
    window = max(1, len(losses) // 50)
    smooth = np.convolve(losses, np.ones(window) / window, mode="valid")
    ax.plot(range(window - 1, window - 1 + len(smooth)), smooth, label=f"mean of {window}")
    ax.set_xlabel("step")
    ax.set_ylabel("symmetric InfoNCE loss")
    ax.set_title("Contrastive training on WordNet")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def exported_minilm(out_dir: Path) -> str:
    """OUT_DIR/minilm when all-MiniLM-L6-v2 was exported there: the evaluation's reference even without distilling."""
    folder = out_dir / "minilm"
    return str(folder) if (folder / MANIFEST_FILE).is_file() else ""


def resolve_teacher(choice: str, out_dir: Path) -> str:
    """The exported teacher's folder for --teacher. Exporting it is a step of its own (`make
    export-pretrained`, which `make train` runs first when it distils), never done from inside training."""
    if choice == "auto":  # the package is a training dependency (make setup installs it)
        choice = "minilm"
    if choice == "none":
        return ""
    folder = out_dir / "minilm" if choice == "minilm" else Path(choice)
    if not (folder / MANIFEST_FILE).is_file():
        hint = "make export-pretrained (python -m export.pretrained --out DIR)" if choice == "minilm" else "make export"
        raise SystemExit(f"--teacher {choice}: no exported model in {folder} (manifest.json missing); run {hint}")
    return str(folder)


def main(argv: Sequence[str] | None = None) -> None:
    defaults = TrainConfig()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--wordnet-dir", default=defaults.wordnet_dir)
    parser.add_argument("--out-dir", default=defaults.out_dir)
    parser.add_argument(
        "--steps", type=int, help=f"default {DISTILLED.steps} when distilling with teacher init, else {PLAIN.steps}"
    )
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size)
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--threads", type=int, default=defaults.threads)
    parser.add_argument(
        "--teacher",
        default="none",
        help="none (InfoNCE only) | minilm (all-MiniLM-L6-v2 exported in OUT_DIR/minilm) | "
        "auto (= minilm) | DIR (an exported teacher)",
    )
    parser.add_argument("--distill-weight", type=float, default=defaults.distill_weight)
    parser.add_argument("--distill-loss", choices=DISTILL_LOSSES, default=defaults.distill_loss)
    parser.add_argument("--no-teacher-init", action="store_true", help="random token embeddings even with a teacher")
    parser.add_argument(
        "--matryoshka-dims",
        default=",".join(map(str, defaults.matryoshka_dims)),
        help="nested prefixes trained to stand alone, comma-separated ('' = off)",
    )
    parser.add_argument(
        "--matryoshka-weight",
        type=float,
        help=f"of each prefix's losses; default {DISTILLED.matryoshka_weight} when distilling with teacher init, "
        f"else {PLAIN.matryoshka_weight}",
    )
    parser.add_argument(
        "--matryoshka-distill",
        action=argparse.BooleanOptionalAction,
        default=defaults.matryoshka_distill,
        help="the teacher's similarity loss on each prefix too",
    )
    parser.add_argument(
        "--prefix-ranking-weight",
        type=float,
        default=defaults.prefix_ranking_weight,
        help="of each prefix's in-batch ranking matched to the full length's",
    )
    parser.add_argument(
        "--prefix-ranking-dims", help="the prefixes the ranking loss applies to (default: --matryoshka-dims)"
    )
    parser.add_argument(
        "--output-axes",
        choices=OUTPUT_AXES,
        default=defaults.output_axes,
        help="after training, order the output's components by what matched texts share, or by variance, or not "
        "(full-length cosines unchanged)",
    )
    parser.add_argument(
        "--vocab-size",
        type=int,
        help=f"WordPiece tokens; default {DISTILLED.vocab_size} when distilling with teacher init, "
        f"else {PLAIN.vocab_size}",
    )
    parser.add_argument("--d-model", type=int, default=defaults.model.d_model)
    parser.add_argument("--layers", type=int, default=defaults.model.n_layers)
    parser.add_argument("--d-ff", type=int, default=defaults.model.d_ff)
    args = parser.parse_args(argv)
    teacher_dir = resolve_teacher(args.teacher, Path(args.out_dir))
    config = replace(
        defaults,
        wordnet_dir=args.wordnet_dir,
        out_dir=args.out_dir,
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        seed=args.seed,
        threads=args.threads,
        vocab_size=args.vocab_size,
        teacher_dir=teacher_dir,
        reference_dir=teacher_dir or exported_minilm(Path(args.out_dir)),
        distill_weight=args.distill_weight,
        distill_loss=args.distill_loss,
        teacher_init=not args.no_teacher_init,
        matryoshka_dims=tuple(int(d) for d in args.matryoshka_dims.split(",") if d.strip()),
        matryoshka_weight=args.matryoshka_weight,
        matryoshka_distill=args.matryoshka_distill,
        prefix_ranking_weight=args.prefix_ranking_weight,
        prefix_ranking_dims=None
        if args.prefix_ranking_dims is None
        else tuple(int(d) for d in args.prefix_ranking_dims.split(",") if d.strip()),
        output_axes=args.output_axes,
        model=replace(defaults.model, d_model=args.d_model, n_layers=args.layers, d_ff=args.d_ff),
    )
    try:
        result = train(config)
    except WordNetNotFound as e:
        raise SystemExit(f"python -m model.train: {e}") from None
    path = save_checkpoint(result.model, result.tokenizer, result.summary, config.out_dir)
    plot_losses(result.losses, Path(config.out_dir) / "loss_curve.png")
    print(f"checkpoint: {path} ({result.summary['train_seconds']} s)")
    print(format_evaluation(result.evaluation, result.summary["model_sizes"]))  # type: ignore[arg-type]
    print(format_comparisons(result.summary["prefix_comparisons"]))  # type: ignore[arg-type]
    outside = result.summary["outside_wordnet"]
    if outside:
        print(f"outside WordNet: Spearman {outside['spearman']:.3f} against {outside['reference']}")  # type: ignore[index]
    trained, untrained, tfidf = (result.evaluation[k]["mrr"] for k in ("trained", "untrained", "tfidf"))
    if not (trained > untrained and trained > tfidf):
        raise SystemExit("trained model does not beat both baselines on held-out MRR")


if __name__ == "__main__":
    main()
