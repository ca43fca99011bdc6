"""Tokenization for serving: lengths counted, long texts cut, ids for the batcher.

Two tokenizer instances are configured once and never mutated (their settings are not safe to change
while other threads encode): one counts the full length, one truncates to the model's limit. Plain
ASCII text goes through twins of the two that do only what BERT's normaliser and pre-tokenizer do to
such text, with the same ids (a test checks). With truncation on, ``cut`` first shortens a long text to
a prefix of whole words that tokenizes exactly like the whole text, so a long input costs a bounded
amount of work and memory.
"""

from __future__ import annotations

import re
import string
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Regex, Tokenizer, normalizers, pre_tokenizers

from server.core.errors import BadInput

CUT_CHARS_PER_TOKEN = 10  # prefix kept per allowed token; real text averages 4-6 characters a token
_LAST_WHITESPACE = re.compile(r"\s\S*\Z")
CUT_WINDOW_CHARS = 64
# ASCII control characters that BERT's normaliser removes or turns into spaces: texts holding any take the
# full normaliser. Tab, newline and carriage return are left out: the pre-tokenizer splits at them anyway.
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
# BERT's pre-tokenizer on such text: words are runs of neither whitespace nor ASCII punctuation, and each
# punctuation character is a word of its own; whitespace (space, tab, newline, carriage return) is dropped.
# Every punctuation character is escaped: the pattern is Oniguruma's, where `&&`, `[` and `-` mean something in a class.
_PUNCTUATION = "".join("\\" + c for c in string.punctuation)
_ASCII_WORDS = rf"[^\s{_PUNCTUATION}]+|[{_PUNCTUATION}]"


@dataclass(frozen=True)
class Encoded:
    rows: list[np.ndarray]  # int64 token ids per input, no padding, special tokens included
    truncated: list[int]  # indices of inputs that were cut to max_length

    @property
    def token_counts(self) -> list[int]:
        return [len(r) for r in self.rows]


@dataclass(frozen=True)
class Token:
    """One token as the model sees it: what `/tokenize` answers."""

    id: int
    text: str
    special: bool  # added by the tokenizer ([CLS], [SEP]), not read from the input
    start: int | None  # character offsets into the input, stop exclusive; None for special tokens
    stop: int | None


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
        self.cut_chars = self.max_length * CUT_CHARS_PER_TOKEN
        # (truncating, counting) for clean ASCII text; None where the normaliser or pre-tokenizer is not BERT's.
        self.ascii_twins = _ascii_twins(self.truncating, self.counting)

    def cut(self, text: str) -> str:
        """A prefix of whole words that tokenizes, truncated, exactly like ``text`` (or ``text`` itself)."""
        if len(text) <= self.cut_chars:
            return text
        # Words are short: look for the last whitespace near the cut first (this runs on the event loop for
        # every long input), then, for a long last word, everywhere before it.
        found = _LAST_WHITESPACE.search(text, max(0, self.cut_chars - CUT_WINDOW_CHARS), self.cut_chars)
        found = found or _LAST_WHITESPACE.search(text, 0, self.cut_chars)
        return text[: found.start()] if found and found.start() > 0 else text  # one giant word: keep it all

    def tokens(self, texts: list[str], add_special_tokens: bool = True) -> list[list[Token]]:
        """Every token of each text, untruncated, with where it came from in the text."""
        return [
            [
                Token(token_id, text, bool(special), None if special else start, None if special else stop)
                for token_id, text, special, (start, stop) in zip(
                    e.ids, e.tokens, e.special_tokens_mask, e.offsets, strict=True
                )
            ]
            for e in self.counting.encode_batch(texts, add_special_tokens=add_special_tokens)
        ]

    def encode(self, texts: list[str], truncate: bool, originals: Sequence[str] | None = None) -> Encoded:
        """Token id rows of ``texts``; ``originals`` are the uncut texts when ``texts`` came from ``cut``."""
        truncating, counting = self.truncating, self.counting
        if self.ascii_twins and all(t.isascii() and not _CONTROL.search(t) for t in originals or texts):
            truncating, counting = self.ascii_twins
        if truncate:
            return self._encode_truncating(truncating, texts, originals or texts)
        encodings = counting.encode_batch_fast(texts)
        rows = [np.asarray(e.ids, dtype=np.int64) for e in encodings]
        too_long = [i for i, r in enumerate(rows) if len(r) > self.max_length]
        if too_long and not truncate:
            i = too_long[0]
            raise BadInput(
                i,
                f"has {len(rows[i])} tokens, more than the limit of {self.max_length}; shorten it or set truncate=true",
            )
        return Encoded(rows, [])

    @staticmethod
    def _encode_truncating(tokenizer: Tokenizer, texts: list[str], originals: Sequence[str]) -> Encoded:
        encodings = tokenizer.encode_batch_fast(texts)
        # A cut text that needed no truncation may owe that to the cut (very long words): redo it whole.
        redo = [i for i, e in enumerate(encodings) if not e.overflowing and len(texts[i]) != len(originals[i])]
        if redo:
            for i, e in zip(redo, tokenizer.encode_batch_fast([originals[i] for i in redo]), strict=True):
                encodings[i] = e
        rows = [np.asarray(e.ids, dtype=np.int64) for e in encodings]
        return Encoded(rows, [i for i, e in enumerate(encodings) if e.overflowing])


def _ascii_twins(truncating: Tokenizer, counting: Tokenizer) -> tuple[Tokenizer, Tokenizer] | None:
    """Copies of the two instances that do only what BERT's normaliser and pre-tokenizer do to clean ASCII
    text."""
    normalizer = truncating.normalizer
    if not (
        isinstance(normalizer, normalizers.BertNormalizer)
        and isinstance(truncating.pre_tokenizer, pre_tokenizers.BertPreTokenizer)
    ):
        return None
    twins = Tokenizer.from_str(truncating.to_str()), Tokenizer.from_str(counting.to_str())
    for twin in twins:  # each its own objects, as each instance has its own everything else
        twin.normalizer = normalizers.Lowercase() if normalizer.lowercase else None
        twin.pre_tokenizer = pre_tokenizers.Split(Regex(_ASCII_WORDS), "removed", invert=True)
    return twins
