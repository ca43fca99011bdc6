from __future__ import annotations

import subprocess
import sys
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


def test_the_vocabulary_is_the_same_in_every_process() -> None:
    # 16 words of one count each: every merge ties, and the vocabulary has room for 3 of the 16. The
    # trainer's hash maps are seeded per process, so only a fresh process shows the difference.
    script = (
        "from model.tokenizer import train_tokenizer\n"
        "texts = ['q' + c for c in 'abcdefghijklmnop']\n"
        "print(sorted(train_tokenizer(texts, vocab_size=40, max_len=8).get_vocab()))\n"
    )
    vocabularies = {
        subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
        for _ in range(6)
    }
    assert len(vocabularies) == 1
    assert "'qa'" in vocabularies.pop()  # the tie goes to the first pair in sorted order, every time
