"""``make export``: checkpoint -> model.onnx, model.torchscript.pt, tokenizer.json, manifest.json.

    python -m export [--model-dir artifacts]

Runs the parity report (export/verify.py) and fails when any bar is missed.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from export.artifacts import export_all, require_gates
from model.checkpoint import CHECKPOINT


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", default="artifacts", help="holds checkpoint.pt and tokenizer.json")
    args = parser.parse_args(argv)
    checkpoint = Path(args.model_dir) / CHECKPOINT
    if not checkpoint.is_file():
        raise SystemExit(f"python -m export: {checkpoint} not found: run `make train` first, or point --model-dir at a "
                         "folder holding checkpoint.pt and tokenizer.json")  # fmt: skip
    manifest, report = export_all(args.model_dir)
    print(f"wrote {', '.join(manifest.files)} to {args.model_dir}")
    require_gates(manifest, report)


if __name__ == "__main__":
    main()
