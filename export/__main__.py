"""``make export``: checkpoint -> model.onnx, model.torchscript.pt, tokenizer.json, manifest.json.

    python -m export [--model-dir artifacts]

Runs the parity report (export/verify.py) and fails when any bar is missed.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from export.artifacts import export_all


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", default="artifacts", help="holds checkpoint.pt and tokenizer.json")
    args = parser.parse_args(argv)
    manifest, report = export_all(args.model_dir)
    print(report.table())
    precision = manifest["precision"]
    assert isinstance(precision, dict)
    for name in ("int8 vs fp32", "fp16 vs fp32"):
        if name in precision:
            p = precision[name]
            print(f"{name} (CPU): mean cosine {p['mean_cosine']:.5f}, worst row {p['worst_row_cosine']:.5f}")
    print(f"int8 build kept: {precision['int8_build']['chosen']}")
    files = manifest["files"]
    assert isinstance(files, dict)
    print(f"wrote {', '.join(files)} to {args.model_dir}")
    if not report.passes():
        raise SystemExit("parity check failed: see the table above")
    if not precision["int8 vs fp32"]["passes"]:
        raise SystemExit("int8 model is below the 0.99 mean cosine bar against fp32")


if __name__ == "__main__":
    main()
