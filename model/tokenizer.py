"""Training and loading the Hugging Face ``tokenizers`` WordPiece tokenizer the model reads.

Every encoding is ``[CLS] text [SEP]``, so even a text with no known characters has real tokens and
mean pooling never divides by zero. Padding and truncation are configured in ``tokenizer.json`` for
the model's maximum length, so the server gets the model's limits from the artifact alone.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

PAD, UNK, CLS, SEP = "[PAD]", "[UNK]", "[CLS]", "[SEP]"
SPECIAL_TOKENS = [PAD, UNK, CLS, SEP]  # PAD first: pad id 0 matches EncoderConfig.pad_id


def train_tokenizer(texts: Iterable[str], vocab_size: int, max_len: int) -> Tokenizer:
    texts = list(texts)
    normalizer = normalizers.BertNormalizer(lowercase=True, strip_accents=True, clean_text=True)
    # The trainer numbers each continuation piece ("##e") when it first meets it, in hash-map order, and
    # breaks ties between equally frequent merges by those numbers. With a large vocabulary the cut-off
    # falls among such ties and the learned set varied between processes (3 of 32,768 tokens). Naming
    # every continuation character up front, sorted, fixes the numbering and so the vocabulary.
    pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    spans = " ".join(set(normalizer.normalize_str("\n".join(texts)).split()))  # each distinct span once
    words = {word for word, _ in pre_tokenizer.pre_tokenize_str(spans)}
    continuations = [f"##{c}" for c in sorted({c for word in words for c in word[1:]})]
    trainer_tokenizer = Tokenizer(models.WordPiece(unk_token=UNK))
    trainer_tokenizer.normalizer = normalizer
    trainer_tokenizer.pre_tokenizer = pre_tokenizer
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS + continuations, show_progress=False
    )
    trainer_tokenizer.train_from_iterator(texts, trainer=trainer)
    # Renumber canonically (special tokens first, then sorted) so that ids never depend on the trainer's
    # internal order, and build the tokenizer afresh so that only the real special tokens are "added"
    # tokens (the continuation pieces are ordinary vocabulary).
    learned = sorted(set(trainer_tokenizer.get_vocab()) - set(SPECIAL_TOKENS))
    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *learned])}
    tokenizer = Tokenizer(models.WordPiece(vocab=vocab, unk_token=UNK))
    tokenizer.normalizer = normalizer
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.WordPiece()
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{CLS} $A {SEP}",
        special_tokens=[(CLS, tokenizer.token_to_id(CLS)), (SEP, tokenizer.token_to_id(SEP))],
    )
    configure(tokenizer, max_len)
    return tokenizer


def configure(tokenizer: Tokenizer, max_len: int) -> Tokenizer:
    """Pad to the longest row of a batch with [PAD] and truncate to the model's max length."""
    tokenizer.enable_padding(pad_id=pad_id(tokenizer), pad_token=PAD)
    tokenizer.enable_truncation(max_length=max_len)
    return tokenizer


def pad_id(tokenizer: Tokenizer) -> int:
    token_id = tokenizer.token_to_id(PAD)
    assert token_id is not None, "tokenizer has no [PAD] token"
    return token_id


def save_tokenizer(tokenizer: Tokenizer, path: Path | str) -> None:
    tokenizer.save(str(path))


def load_tokenizer(path: Path | str) -> Tokenizer:
    return Tokenizer.from_file(str(path))
