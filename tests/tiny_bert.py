"""A tiny randomly initialised sentence-transformers BERT folder, written by the tests themselves, so CI
needs neither the 90 MB all-MiniLM-L6-v2 package nor a model hub."""

from __future__ import annotations

import json
from pathlib import Path

SENTENCES = [
    "a dog runs",
    "the quick brown fox jumps over the lazy dog near the river bank",
    "embeddings",
    "a cat sleeps on the warm mat while the dog runs in the garden",
]
MAX_SEQ_LENGTH = 24


def write_tiny_bert(folder: Path, seed: int = 0) -> Path:
    import torch
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import BertConfig, BertModel

    words = sorted({w for s in SENTENCES for w in s.split()})
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    pieces = [f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz"]
    tokens = dict.fromkeys(specials + words + list("abcdefghijklmnopqrstuvwxyz") + pieces)  # "a" is a word too
    vocab = {token: i for i, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])]
    )
    config = BertConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        type_vocab_size=2,
        layer_norm_eps=1e-12,
        hidden_act="gelu",
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    model = BertModel(config)
    with torch.no_grad():  # every weight away from its init, LayerNorm scales included: a wrong mapping shows
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if "LayerNorm.weight" in name else 0.0))
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder), safe_serialization=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 32, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True})
    )
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": MAX_SEQ_LENGTH}))
    return folder
