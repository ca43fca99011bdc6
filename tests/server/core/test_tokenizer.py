"""The serving tokenizer: cutting long texts before tokenizing gives exactly the whole text's ids."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from server.core.errors import InvalidInput
from server.core.pipeline import Limits, validate
from server.core.tokenizer import TextTokenizer

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


ascii_texts = st.text(st.characters(max_codepoint=127), min_size=1, max_size=300)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.one_of(ascii_texts, st.lists(words, min_size=1, max_size=40).map(" ".join)))
@example(text="[CLS] The [SEP]river[MASK] [cls] [UNK]")  # special tokens are found before any normaliser
@example(text="don't--stop!!the (quick) fox's \"bank\"...a.b,c_d\\e~f`g^h|i{j}k@l")
@example(text=" \t the\r\nriver\n\n  bank \t")
def test_the_ascii_twins_give_the_full_normalisers_ids(tokenizer: TextTokenizer, text: str) -> None:
    """Clean ASCII takes the twins (lowercasing only, words found by one ASCII pattern); anything else,
    control characters included, the full normaliser and BERT's pre-tokenizer. Either way the ids are the
    full tokenizer's, truncated or not."""
    assert tokenizer.ascii_twins is not None  # the tiny tokenizer's normaliser and pre-tokenizer are BERT's
    truncated = tokenizer.encode([text], truncate=True).rows[0].tolist()
    assert truncated == tokenizer.truncating.encode(text).ids
    full = tokenizer.counting.encode(text).ids
    if len(full) <= tokenizer.max_length:
        assert tokenizer.encode([text], truncate=False).rows[0].tolist() == full


def test_only_clean_ascii_takes_the_twins(tokenizer: TextTokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    used = []
    twins = tokenizer.ascii_twins
    assert twins is not None

    class Spy:
        def __init__(self, inner: object) -> None:
            self.inner = inner

        def encode_batch_fast(self, texts: list[str]) -> object:
            used.append(texts)
            return self.inner.encode_batch_fast(texts)  # type: ignore[attr-defined]

    monkeypatch.setattr(tokenizer, "ascii_twins", (Spy(twins[0]), Spy(twins[1])))
    tokenizer.encode(["The River\tBank"], truncate=True)
    tokenizer.encode(["The River Bank"], truncate=False)
    assert used == [["The River\tBank"], ["The River Bank"]]
    for text in ("café", "bell\x07", "null\x00"):
        tokenizer.encode([text], truncate=True)
    assert len(used) == 2


def test_no_twins_where_the_pre_tokenizer_is_not_berts(tiny_artifacts: Path, tmp_path: Path) -> None:
    """The twins' pattern stands in for BERT's pre-tokenizer only: with another, every text takes the full tokenizer."""
    from tokenizers import Tokenizer, pre_tokenizers

    other = Tokenizer.from_file(str(tiny_artifacts / "tokenizer.json"))
    other.pre_tokenizer = pre_tokenizers.Whitespace()
    other.save(str(tmp_path / "tokenizer.json"))
    tokenizer = TextTokenizer(tmp_path / "tokenizer.json")
    assert tokenizer.ascii_twins is None
    assert tokenizer.encode(["don't stop"], truncate=True).rows[0].tolist() == other.encode("don't stop").ids
