"""Load a sentence-transformers BERT checkpoint into our encoder (model/transformer.py).

A sentence-transformers folder holds ``config.json`` (Hugging Face ``BertModel``), ``model.safetensors``,
``tokenizer.json``, ``1_Pooling/config.json`` and optionally ``sentence_bert_config.json`` (max length).
Our encoder is that architecture with a few switches set (learned positions, token-type embedding,
embedding LayerNorm, GELU, post-LN, no sqrt(d_model) scaling), so the weights map one to one; Q, K and V
are concatenated into our fused projection. Anything the mapping does not cover is refused with the
reason, never approximated: other architectures, other position encodings, pooling other than mean.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from model.transformer import Encoder, EncoderConfig


class UnsupportedCheckpoint(ValueError):
    """The checkpoint is valid but not one this loader can map exactly."""


@dataclass(frozen=True)
class Pretrained:
    model: Encoder
    tokenizer: Tokenizer  # truncating to the model's max length, padding with its pad id
    model_id: str  # the checkpoint's own name (config.json's _name_or_path, else the folder's name)


def _read_json(path: Path) -> dict:  # type: ignore[type-arg]
    if not path.is_file():
        raise UnsupportedCheckpoint(f"{path} not found: a sentence-transformers BERT folder has it")
    return dict(json.loads(path.read_text()))


def encoder_config(hf: dict, max_len: int) -> EncoderConfig:  # type: ignore[type-arg]
    """Our EncoderConfig for a Hugging Face BERT config.json; refuses what we cannot reproduce exactly."""
    problems = []
    if hf.get("model_type") != "bert":
        problems.append(f"model_type {hf.get('model_type')!r} (only bert is supported)")
    if hf.get("position_embedding_type", "absolute") != "absolute":
        problems.append(f"position_embedding_type {hf['position_embedding_type']!r} (only absolute)")
    if hf.get("hidden_act") != "gelu":
        problems.append(f"hidden_act {hf.get('hidden_act')!r} (only gelu, the exact one)")
    if hf.get("is_decoder") or hf.get("add_cross_attention"):
        problems.append("a decoder configuration")
    if problems:
        raise UnsupportedCheckpoint("unsupported checkpoint: " + "; ".join(problems))
    return EncoderConfig(
        vocab_size=hf["vocab_size"],
        max_len=min(max_len, hf["max_position_embeddings"]),
        d_model=hf["hidden_size"],
        n_heads=hf["num_attention_heads"],
        n_layers=hf["num_hidden_layers"],
        d_ff=hf["intermediate_size"],
        dropout=0.0,
        norm_first=False,
        layer_norm_eps=hf["layer_norm_eps"],
        pad_id=hf.get("pad_token_id", 0) or 0,
        positions="learned",
        type_vocab_size=hf["type_vocab_size"],
        embedding_norm=True,
        activation="gelu",
        scale_embeddings=False,
    )


def _check_pooling(folder: Path) -> None:
    pooling = _read_json(folder / "1_Pooling" / "config.json")
    modes = {key for key, on in pooling.items() if key.startswith("pooling_mode_") and on}
    if modes != {"pooling_mode_mean_tokens"}:
        raise UnsupportedCheckpoint(
            f"unsupported pooling {sorted(modes)}: only mean pooling (pooling_mode_mean_tokens)"
        )


def state_dict_from_bert(weights: dict[str, torch.Tensor], config: EncoderConfig) -> dict[str, torch.Tensor]:
    """Our parameter names for a BertModel's weights (with or without the ``bert.`` prefix)."""
    w = {name.removeprefix("bert."): tensor for name, tensor in weights.items()}

    def take(name: str) -> torch.Tensor:
        if name not in w:
            raise UnsupportedCheckpoint(f"model.safetensors has no {name}: not a BertModel checkpoint")
        return w[name]

    out = {
        "token_embedding.weight": take("embeddings.word_embeddings.weight"),
        "positional_encoding.table.weight": take("embeddings.position_embeddings.weight")[: config.max_len],
        "token_type_embedding.weight": take("embeddings.token_type_embeddings.weight"),
        "embedding_norm.weight": take("embeddings.LayerNorm.weight"),
        "embedding_norm.bias": take("embeddings.LayerNorm.bias"),
    }
    for i in range(config.n_layers):
        src, dst = f"encoder.layer.{i}.", f"layers.{i}."
        qkv = ("query", "key", "value")
        out[dst + "attention.qkv.weight"] = torch.cat([take(f"{src}attention.self.{p}.weight") for p in qkv])
        out[dst + "attention.qkv.bias"] = torch.cat([take(f"{src}attention.self.{p}.bias") for p in qkv])
        for ours, theirs in (
            ("attention.out", "attention.output.dense"),
            ("norm1", "attention.output.LayerNorm"),
            ("feed_forward.fc_in", "intermediate.dense"),
            ("feed_forward.fc_out", "output.dense"),
            ("norm2", "output.LayerNorm"),
        ):
            out[f"{dst}{ours}.weight"] = take(f"{src}{theirs}.weight")
            out[f"{dst}{ours}.bias"] = take(f"{src}{theirs}.bias")
    return {name: tensor.float().contiguous() for name, tensor in out.items()}


def from_pretrained(folder: Path | str) -> Pretrained:
    """Our encoder with a sentence-transformers BERT checkpoint's weights, and its tokenizer."""
    from safetensors.torch import load_file

    folder = Path(folder)
    hf = _read_json(folder / "config.json")
    _check_pooling(folder)
    st_config = folder / "sentence_bert_config.json"
    max_len = int(json.loads(st_config.read_text()).get("max_seq_length", 512)) if st_config.is_file() else 512
    config = encoder_config(hf, max_len)
    weights_path = folder / "model.safetensors"
    if not weights_path.is_file():
        raise UnsupportedCheckpoint(f"{weights_path} not found (only safetensors weights are read)")
    model = Encoder(config)
    model.load_state_dict(state_dict_from_bert(load_file(str(weights_path)), config), strict=True)
    model.eval()

    tokenizer_path = folder / "tokenizer.json"
    if not tokenizer_path.is_file():
        raise UnsupportedCheckpoint(f"{tokenizer_path} not found")
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    pad_token = tokenizer.id_to_token(config.pad_id) or "[PAD]"
    tokenizer.enable_truncation(max_length=config.max_len)
    tokenizer.enable_padding(pad_id=config.pad_id, pad_token=pad_token)
    model_id = str(hf.get("_name_or_path") or folder.name)
    return Pretrained(model, tokenizer, model_id)
