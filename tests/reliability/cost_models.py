"""Untrained models with the real models' cost per token, for the flood tests.

A forward pass costs the same whatever the weights learned, so an untrained encoder of the shipped
configuration (what `make train` trains) and one of all-MiniLM-L6-v2's shape stand in for the real
ones where only time and memory are measured. Only what the server loads is written: model.onnx,
tokenizer.json and manifest.json.

    python -m tests.reliability.cost_models OUT_DIR [--minilm]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from contract.manifest import Manifest
from model.outside import stdlib_sentences
from tests.reliability.flood import WORDS

# all-MiniLM-L6-v2's shape: 27x the trained model's FLOPs per token.
MINILM_SIZE = {"d_model": 384, "n_layers": 6, "n_heads": 12, "d_ff": 1536}


def build(out_dir: Path, minilm: bool = False, seed: int = 0) -> Path:
    import torch

    from export.onnx_export import export_onnx
    from model.tokenizer import save_tokenizer, train_tokenizer
    from model.train import TrainConfig
    from model.transformer import Encoder, EncoderConfig

    shipped = TrainConfig().model  # the configuration `make train` trains
    texts = [*stdlib_sentences(400, seed), " ".join(WORDS)]
    tokenizer = train_tokenizer(texts, vocab_size=2000, max_len=shipped.max_len)
    size = MINILM_SIZE if minilm else {}
    config = EncoderConfig(**{**shipped.to_dict(), **size, "vocab_size": tokenizer.get_vocab_size(), "dropout": 0.0})
    torch.manual_seed(seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    export_onnx(Encoder(config).eval(), out_dir / "model.onnx")
    save_tokenizer(tokenizer, out_dir / "tokenizer.json")
    Manifest(
        model_id="untrained-minilm-size" if minilm else "untrained-shipped-size",
        model_version="untrained",
        config=config.to_dict(),
        dim=config.d_model,
        max_length=config.max_len,
        vocab_size=config.vocab_size,
        pad_id=config.pad_id,
    ).write(out_dir)
    return out_dir


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--minilm", action="store_true")
    args = parser.parse_args()
    print(build(args.out_dir, args.minilm))
