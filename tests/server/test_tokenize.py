"""The serving tokenizer: cutting long texts before tokenizing gives exactly the whole text's ids."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server.errors import InvalidInput
from server.pipeline import Limits, validate
from server.tokenize import TextTokenizer

words = st.one_of(
    st.sampled_from(["the", "river", "photosynthesis", "a", "lungs", "x" * 150, "naïve", "café", ",", "!"]),
    st.text(st.characters(codec="utf-8"), min_size=1, max_size=12),
)
separators = st.sampled_from([" ", "  ", "\n", "\t", " \u3000 ", ""])


@pytest.fixture(scope="module")
def tokenizer(tiny_artifacts: Path) -> TextTokenizer:
    return TextTokenizer(tiny_artifacts / "tokenizer.json")


def whole(tokenizer: TextTokenizer, text: str) -> tuple[list[int], bool]:
    """The reference: tokenize everything, then truncate."""
    ids = tokenizer.counting.encode(text).ids
    if len(ids) <= tokenizer.max_length:
        return ids, False
    return tokenizer.truncating.encode(text).ids, True


def longest_whole_word_prefix(text: str, chars: int) -> str:
    """The reference cut: up to the last whitespace within ``chars``, found by scanning all of them."""
    if len(text) <= chars:
        return text
    spaces = [i for i in range(1, chars) if text[i].isspace()]
    return text[: spaces[-1]] if spaces else text


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(parts=st.lists(st.tuples(words, separators), min_size=1, max_size=600))
def test_cut_texts_tokenize_exactly_like_whole_texts(tokenizer: TextTokenizer, parts) -> None:  # type: ignore[no-untyped-def]
    text = "".join(w + s for w, s in parts)
    assert tokenizer.cut(text) == longest_whole_word_prefix(text, tokenizer.cut_chars)
    encoded = tokenizer.encode([tokenizer.cut(text)], truncate=True, originals=[text])
    ids, truncated = whole(tokenizer, text)
    assert encoded.rows[0].tolist() == ids
    assert encoded.truncated == ([0] if truncated else [])


def test_a_long_text_is_cut_to_a_bounded_prefix_before_tokenizing(tokenizer: TextTokenizer) -> None:
    text = "the quiet river " * 1250  # 20,000 characters
    prepared = tokenizer.cut(text)
    assert len(prepared) <= tokenizer.cut_chars < 1000 and text.startswith(prepared)
    giant_word = tokenizer.cut("x" * 20_000)  # no word boundary: kept whole
    assert len(giant_word) == 20_000
    limits = Limits(max_client_batch_size=4, max_input_chars=20_000)
    assert validate([text], limits) == [text]  # the pipeline cuts only with truncation on: here nothing is cut


def test_without_truncation_a_long_text_is_refused_naming_it(tokenizer: TextTokenizer) -> None:
    with pytest.raises(InvalidInput, match=r"inputs\[1\] has \d+ tokens, more than the limit of 32"):
        tokenizer.encode(["short", "word " * 100], truncate=False)
    assert np.array_equal(tokenizer.encode(["short"], truncate=False).rows[0], whole(tokenizer, "short")[0])
