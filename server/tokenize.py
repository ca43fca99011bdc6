"""Tokenization for serving: validation of lengths and truncation with the artifact's tokenizer.

Two tokenizer instances are configured once and never mutated (Tokenizer settings are not safe to
change while other threads encode): one counts the full length, one truncates to the model's limit.
``encode_batch`` releases the GIL, so callers run ``encode`` in worker threads.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from server.errors import InvalidInput


@dataclass(frozen=True)
class Encoded:
    rows: list[np.ndarray]  # int64 token ids per input, no padding, special tokens included
    truncated: list[int]  # indices of inputs that were cut to max_length

    @property
    def token_counts(self) -> list[int]:
        return [len(r) for r in self.rows]


class TextTokenizer:
    def __init__(self, path: Path | str) -> None:
        self.truncating = Tokenizer.from_file(str(path))
        truncation = self.truncating.truncation
        if not truncation:
            raise ValueError(f"{path} has no truncation configured: it must carry the model's max length")
        self.max_length: int = truncation["max_length"]
        self.truncating.no_padding()
        self.counting = Tokenizer.from_file(str(path))
        self.counting.no_padding()
        self.counting.no_truncation()

    def encode(self, texts: list[str], truncate: bool) -> Encoded:
        encodings = self.counting.encode_batch(texts)
        rows = [np.asarray(e.ids, dtype=np.int64) for e in encodings]
        too_long = [i for i, r in enumerate(rows) if len(r) > self.max_length]
        if too_long and not truncate:
            i = too_long[0]
            raise InvalidInput(
                f"inputs[{i}] has {len(rows[i])} tokens, more than the limit of {self.max_length}; "
                "shorten it or set truncate=true"
            )
        if too_long:
            for i, e in zip(too_long, self.truncating.encode_batch([texts[i] for i in too_long]), strict=True):
                rows[i] = np.asarray(e.ids, dtype=np.int64)
        return Encoded(rows, too_long)
