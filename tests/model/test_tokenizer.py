from __future__ import annotations

from pathlib import Path

from model.tokenizer import CLS, PAD, SEP, load_tokenizer, pad_id, save_tokenizer, train_tokenizer

TEXTS = ["The quick brown fox jumps over the lazy dog.", "A dog is a domesticated carnivore."] * 50


def test_trained_tokenizer_lowercases_wraps_pads_and_truncates(tmp_path: Path) -> None:
    tokenizer = train_tokenizer(TEXTS, vocab_size=200, max_len=8)
    assert pad_id(tokenizer) == 0 and tokenizer.id_to_token(0) == PAD
    short, long = tokenizer.encode_batch(["THE DOG", "the quick brown fox jumps over the lazy dog"])
    assert short.tokens[0] == CLS and short.tokens[:4] == [CLS, "the", "dog", SEP]
    assert len(short.ids) == len(long.ids) == 8  # padded to the longest, truncated to max_len
    assert short.attention_mask == [1, 1, 1, 1, 0, 0, 0, 0]
    assert long.tokens[-1] == SEP and sum(long.attention_mask) == 8

    path = tmp_path / "tokenizer.json"
    save_tokenizer(tokenizer, path)
    loaded = load_tokenizer(path)
    assert loaded.encode("the lazy dog").ids == tokenizer.encode("the lazy dog").ids
    assert loaded.truncation["max_length"] == 8
    assert loaded.padding["pad_id"] == 0


def test_text_without_known_characters_still_has_tokens() -> None:
    tokenizer = train_tokenizer(TEXTS, vocab_size=200, max_len=8)
    encoding = tokenizer.encode("   ")
    assert encoding.tokens == [CLS, SEP]
