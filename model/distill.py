"""Distillation from an exported teacher (all-MiniLM-L6-v2 by default) for the brief training.

The teacher runs once, in ONNX Runtime, over every training text; its normalised embeddings are cached on
disk, keyed by the teacher's version, the file it runs and the texts. It runs the export's teacher build
(contract.manifest.TEACHER_FILE), an int8 build fast enough for the first run's time budget (decisions/0028).
The student starts from the teacher's token embeddings, reduced by PCA to its width (teacher_token_init).
The loss (model/losses.py) pulls the student's cosine-similarity matrix over a batch towards the teacher's:
no projection between the widths, nothing added to the exported model.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from contract.manifest import MODEL_FILES, TEACHER_FILE, Manifest
from model.checkpoint import written_aside

TEACHER_PRECISION = "int8"
TEACHER_MAX_TOKENS = 32  # the student's training truncation: both see the same text
TEACHER_BATCH = 128
SIDE_BY_SIDE_MAX_TOKENS = 32  # texts truncated to at most this run one batch per core at once (run_teacher)


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def cache_key(teacher_dir: Path, texts: Sequence[str], max_tokens: int, precision: str, dtype: str) -> str:
    manifest = Manifest.read(teacher_dir)
    digest = hashlib.sha256()
    build = manifest.files.get(teacher_file(teacher_dir, precision).name, "")  # the file the teacher runs, by digest
    digest.update(f"{manifest.model_id}|{manifest.model_version}|{precision}|{build}|{max_tokens}|{dtype}".encode())
    for text in texts:
        digest.update(text.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def teacher_file(teacher_dir: Path, precision: str) -> Path:
    """What the teacher runs at a precision: in int8 the export's teacher build, where the folder has one."""
    if precision == "int8" and (teacher_dir / TEACHER_FILE).is_file():
        return teacher_dir / TEACHER_FILE
    return teacher_dir / MODEL_FILES[precision]


def teacher_session(teacher_dir: Path, precision: str, threads: int = 0) -> Any:
    """An ONNX Runtime session on the exported teacher's CPU build: on `threads` threads, spinning (compute
    dominates); 0 = one per core. With one thread, each call runs on its caller's thread."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.add_session_config_entry("session.intra_op.allow_spinning", "1")
    options.add_session_config_entry("session.set_denormal_as_zero", "1")
    path = teacher_file(teacher_dir, precision)
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def run_teacher(
    teacher_dir: Path, texts: Sequence[str], max_tokens: int = TEACHER_MAX_TOKENS, precision: str = TEACHER_PRECISION
) -> np.ndarray:
    """(N, D) float32, L2-normalised: the exported teacher's embeddings of texts, in order."""
    from tokenizers import Tokenizer

    from model.checkpoint import encode_texts

    manifest = Manifest.read(teacher_dir)
    tokenizer = Tokenizer.from_file(str(teacher_dir / "tokenizer.json"))
    rows = encode_texts(tokenizer, texts, max_tokens)
    # Short texts: one call per core at once, each on one thread, faster than one call at a time on every
    # core, each row the same to the bit; longer ones: one call at a time on every core (decisions/0014).
    side_by_side = cores() if max_tokens <= SIDE_BY_SIDE_MAX_TOKENS else 1
    session = teacher_session(teacher_dir, precision, threads=1 if side_by_side > 1 else 0)
    out = np.zeros((len(rows), int(session.get_outputs()[0].shape[1])), dtype=np.float32)
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]))  # little padding per batch
    chunks = [order[start : start + TEACHER_BATCH] for start in range(0, len(order), TEACHER_BATCH)]

    def embed(chunk: list[int]) -> int:
        """Runs one batch; returns its padded tokens."""
        batch = [rows[i] for i in chunk]
        ids = np.full((len(batch), max(len(r) for r in batch)), manifest.pad_id, dtype=np.int64)
        mask = np.zeros_like(ids)
        for row, tokens in enumerate(batch):
            ids[row, : len(tokens)], mask[row, : len(tokens)] = tokens, 1
        out[chunk] = session.run(["embeddings"], {"input_ids": ids, "attention_mask": mask})[0]
        return ids.size

    padded = sum(len(chunk) * len(rows[chunk[-1]]) for chunk in chunks)  # in length order: the last is the longest
    # Minutes on 2 cores for the training corpus: shown as it goes. The bar counts padded tokens, not batches:
    # the batches grow longer as they go, so a count of batches would promise a third of the time it takes.
    with (
        ThreadPoolExecutor(side_by_side) as pool,  # ONNX Runtime releases the GIL while it runs
        tqdm(total=padded, desc="teacher embeddings", unit="token", unit_scale=True, mininterval=1.0,
             disable=len(chunks) < 20) as bar,
    ):  # fmt: skip
        for tokens in pool.map(embed, chunks):
            bar.update(tokens)
    return out / np.linalg.norm(out, axis=1, keepdims=True)


def teacher_embeddings(
    teacher_dir: Path,
    texts: Sequence[str],
    cache_dir: Path,
    max_tokens: int = TEACHER_MAX_TOKENS,
    precision: str = TEACHER_PRECISION,
    dtype: str = "float16",
) -> tuple[np.ndarray, dict[str, object]]:
    """The teacher's embeddings of texts, from the cache when it holds them. Returns them and a summary.
    Stored as dtype (float16 halves the disk for training targets; float32 keeps evaluations exact) and used
    as stored, so a first and a repeat run give identical results."""
    path = cache_dir / f"teacher-{cache_key(teacher_dir, texts, max_tokens, precision, dtype)}.npy"
    started = time.perf_counter()
    if path.is_file():
        embeddings, cached = np.load(path), True
    else:
        embeddings, cached = run_teacher(teacher_dir, texts, max_tokens, precision).astype(dtype), False
        cache_dir.mkdir(parents=True, exist_ok=True)
        with written_aside(path) as partial, open(partial, "wb") as file:  # a file: np.save adds .npy to a name
            np.save(file, embeddings)
    embeddings = embeddings.astype(np.float32)
    teacher_id = Manifest.read(teacher_dir).model_id
    summary = {
        "teacher": teacher_id,
        "teacher_texts": len(texts),
        "teacher_cache": "hit" if cached else "computed",
        "teacher_seconds": round(time.perf_counter() - started, 1),
    }
    return embeddings, summary


def token_strings(vocab: Sequence[str]) -> list[str]:
    """The text of each WordPiece token: a continuation piece ("##ing") without its marker."""
    return [t[2:] if t.startswith("##") and len(t) > 2 else t for t in vocab]


def teacher_token_init(teacher_embeddings_of_tokens: np.ndarray, width: int) -> np.ndarray:
    """Token-embedding rows for a student of this width from the teacher's embedding of each token alone
    (as model2vec distils a static model): centred, reduced by PCA to width, scaled to a mean row norm of 1,
    the norm of the encoder's random initialisation. Columns past the teacher's own width stay zero.
    (V, D) -> (V, width)."""
    centred = teacher_embeddings_of_tokens - teacher_embeddings_of_tokens.mean(axis=0)
    _, _, components = np.linalg.svd(centred, full_matrices=False)  # rows: directions of most variance first
    kept = components[:width]
    reduced = np.zeros((len(centred), width), dtype=np.float64)
    reduced[:, : len(kept)] = centred @ kept.T
    return (reduced / np.linalg.norm(reduced, axis=1).mean()).astype(np.float32)


def flops_per_token(n_layers: int, d_model: int, d_ff: int) -> int:
    """Forward matmul FLOPs per token of an encoder, without attention's sequence-length term:
    per layer Q, K, V and output projections (4 d^2) and the feed-forward (2 d d_ff), 2 FLOPs per MAC."""
    return 2 * n_layers * (4 * d_model * d_model + 2 * d_model * d_ff)
