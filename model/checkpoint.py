"""The trained model's files and the token ids training sees: checkpoint I/O and ``encode_texts``.

Training writes the checkpoint; the export reads it. Both import this module, never each other.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
from tokenizers import Tokenizer

from model.tokenizer import save_tokenizer
from model.transformer import Encoder, EncoderConfig

CHECKPOINT = "checkpoint.pt"


def save_checkpoint(model: Encoder, tokenizer: Tokenizer, summary: dict[str, object], out_dir: Path | str) -> Path:
    """Writes tokenizer.json, evaluation.json (the summary) and checkpoint.pt into out_dir.

    checkpoint.pt is what `make` takes for a finished training: an earlier one goes first and the new one
    comes last, written aside and renamed, so a run stopped part-way leaves none (make then trains again),
    never a checkpoint beside another run's tokenizer."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / CHECKPOINT
    path.unlink(missing_ok=True)
    save_tokenizer(tokenizer, out / "tokenizer.json")
    (out / "evaluation.json").write_text(json.dumps(summary, indent=2) + "\n")
    with written_aside(path) as partial:
        torch.save({"config": model.config.to_dict(), "state_dict": model.state_dict(), "summary": summary}, partial)
    return path


@contextmanager
def written_aside(path: Path) -> Iterator[Path]:
    """A path beside ``path`` to write to, renamed to ``path`` when the block ends and removed when it raises:
    a run stopped mid-write (Ctrl-C) leaves nothing under the name that a later run trusts."""
    partial = path.with_name(path.name + ".partial")
    try:
        yield partial
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def load_checkpoint(path: Path | str) -> tuple[Encoder, dict[str, object]]:
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    model = Encoder(EncoderConfig(**checkpoint["config"]))
    model.load_state_dict(checkpoint["state_dict"])
    model.eval()
    return model, checkpoint["summary"]


def encode_texts(tokenizer: Tokenizer, texts: Sequence[str], max_len: int) -> list[list[int]]:
    """Token ids of each text, unpadded, truncated to max_len (or the tokenizer's own limit, if lower)
    with [SEP] kept last."""
    unpadded = Tokenizer.from_str(tokenizer.to_str())  # a copy: the caller's settings stay as they are
    unpadded.no_padding()
    limit = min(max_len, (tokenizer.truncation or {}).get("max_length", max_len))
    unpadded.enable_truncation(limit)  # truncation leaves room for the template's [CLS] and [SEP]
    return [e.ids for e in unpadded.encode_batch(list(texts))]
