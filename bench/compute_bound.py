"""A MiniLM-sized configuration of our encoder, exported by the same export code, for `make bench`.

d_model 384, 6 layers, 12 heads, d_ff 1536 (the shape of all-MiniLM-L6-v2), untrained: the speed of a
forward pass does not depend on what the weights learned. Our tokenizer and vocabulary are kept, so the
same texts and the same server run it. This is where compute per text is large enough for batching and
int8 to pay, which the 1.5 M-parameter trained model cannot show on a CPU.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from contract.manifest import MANIFEST_FILE, Manifest

MINILM_SIZE = {"d_model": 384, "n_layers": 6, "n_heads": 12, "d_ff": 1536}
BUILD_MARK = "bench-build.json"


def code_digest() -> str:
    """sha256 over the model and export sources: what the built artifacts depend on besides the config."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted([root / "model" / "transformer.py", *(root / "export").glob("*.py")]):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def build(source_dir: Path, out_dir: Path, seed: int = 0) -> Manifest:
    """Writes out_dir with every serving artifact (export_all); reuses it when already built for this
    configuration. Returns the manifest."""
    import torch

    from export.artifacts import TOKENIZER_FILE, export_all
    from model.checkpoint import CHECKPOINT
    from model.transformer import Encoder, EncoderConfig

    source = Manifest.read(source_dir).config
    config = EncoderConfig(**{**source, **MINILM_SIZE, "dropout": 0.0})
    # Rebuilt when the configuration or the code that builds it changes (a new quantization, say).
    wanted = {"config": config.to_dict(), "seed": seed, "code": code_digest()}
    mark = out_dir / BUILD_MARK
    if mark.is_file() and json.loads(mark.read_text()) == wanted and (out_dir / MANIFEST_FILE).is_file():
        return Manifest.read(out_dir)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    torch.manual_seed(seed)
    model = Encoder(config).eval()
    summary = {"note": "untrained, for speed measurements only"}
    torch.save({"config": config.to_dict(), "state_dict": model.state_dict(), "summary": summary}, out_dir / CHECKPOINT)
    shutil.copy(source_dir / TOKENIZER_FILE, out_dir / TOKENIZER_FILE)
    manifest, report = export_all(out_dir)
    if not report.passes():
        raise SystemExit(f"parity failed for the MiniLM-sized export:\n{report.table()}")
    mark.write_text(json.dumps(wanted))
    return manifest
