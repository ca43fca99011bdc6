"""Writes every serving artifact of a checkpoint and the manifest that describes them."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from contract.manifest import CPU_MODEL_FILE, MODEL_FILES, TEACHER_FILE, TOKENIZER_FILE, Manifest, file_sha256
from export.attention_fusion import export_cpu_graph
from export.onnx_export import INPUT_NAMES, OUTPUT_NAME, export_onnx, onnx_opset
from export.quantize import FP16_FILE, INT8_FILE, export_fp16, export_int8
from export.torchscript import export_torchscript
from export.triton import write_triton_repository
from export.verify import ParityReport, precision_report, verify_artifacts
from model.checkpoint import CHECKPOINT, load_checkpoint
from model.tokenizer import load_tokenizer
from model.transformer import Encoder

ONNX_FILE = MODEL_FILES["fp32"]
TORCHSCRIPT_FILE = "model.torchscript.pt"
MODEL_ID = "wordnet-encoder"


@contextmanager
def step(model_id: str, what: str) -> Iterator[None]:
    """Exporting all-MiniLM-L6-v2 takes minutes on 2 cores: each step says what it does and what it took."""
    started = time.perf_counter()
    print(f"export {model_id}: {what} ...", flush=True)
    yield
    print(f"export {model_id}: {what}: {time.perf_counter() - started:.0f} s", flush=True)


def weights_digest(model: Encoder) -> str:
    """sha256 of the model's config and weights (names, dtypes, shapes, values) and nothing else, so two
    builds of the same weights get the same version wherever and whenever they were made (the checkpoint
    file also holds the training summary: timings, the source's path)."""
    digest = hashlib.sha256(json.dumps(model.config.to_dict(), sort_keys=True).encode())
    for name, tensor in sorted(model.state_dict().items()):
        values = tensor.detach().cpu().contiguous()
        digest.update(f"{name}|{values.dtype}|{tuple(values.shape)}|".encode())
        digest.update(values.flatten().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def export_all(
    model_dir: Path | str, model_id: str = MODEL_ID, source: str = "trained here (make train)"
) -> tuple[Manifest, ParityReport]:
    """Writes every artifact; the ParityReport is eager/TorchScript/ONNX/the CPU graph (the gate), the manifest also
    carries the int8/fp16 figures. model_id and source name where the weights came from."""
    model_dir = Path(model_dir)
    model, summary = load_checkpoint(model_dir / CHECKPOINT)
    tokenizer = load_tokenizer(model_dir / TOKENIZER_FILE)
    padding = tokenizer.padding or {}
    truncation = tokenizer.truncation or {}
    assert padding.get("pad_id") == model.config.pad_id, "tokenizer pad id differs from the model's"
    assert truncation.get("max_length") == model.config.max_len, "tokenizer max length differs from the model's"

    config = model.config
    with step(model_id, "TorchScript and ONNX"):
        export_torchscript(model, model_dir / TORCHSCRIPT_FILE)
        export_onnx(model, model_dir / ONNX_FILE)
        export_cpu_graph(model_dir / ONNX_FILE, model_dir / CPU_MODEL_FILE, config.n_heads, config.n_layers)
    with step(model_id, "parity of eager PyTorch, TorchScript and ONNX Runtime"):
        report = verify_artifacts(model_dir)
    with step(model_id, "fp16 build; int8 builds, timed; both compared with fp32"):
        export_fp16(model_dir)
        int8_choice, rows = export_int8(
            model_dir, config.n_heads, config.d_model, config.max_len, report.reference_batches, config.vocab_size,
            compare_also={"fp16": model_dir / FP16_FILE},
        )  # fmt: skip
        precision = precision_report(rows)
    triton = write_triton_repository(model_dir, model_id.rsplit("/", 1)[-1])  # a folder name: no owner/

    files = [ONNX_FILE, CPU_MODEL_FILE, TORCHSCRIPT_FILE, TOKENIZER_FILE, INT8_FILE, TEACHER_FILE, FP16_FILE]
    manifest = Manifest(
        model_id=model_id,
        source=source,
        model_version=weights_digest(model)[:12],  # changes when, and only when, the config or weights do
        config=model.config.to_dict(),
        dim=model.config.d_model,
        max_length=model.config.max_len,
        vocab_size=model.config.vocab_size,
        pad_id=model.config.pad_id,
        opset=onnx_opset(model_dir / ONNX_FILE),
        inputs=tuple(INPUT_NAMES),
        output=OUTPUT_NAME,
        normalized=False,
        # Embedding lengths built and measured to stand alone (shortened lengths and the full width).
        matryoshka_dims=tuple(summary.get("matryoshka_dims", [model.config.d_model])),  # type: ignore[arg-type]
        files={name: file_sha256(model_dir / name) for name in files},
        training=summary,
        parity=report.to_dict(),
        precision={**precision, "int8_build": int8_choice},
        triton_repository=str(triton.relative_to(model_dir)),
    )
    manifest.write(model_dir)
    return manifest, report


def require_gates(manifest: Manifest, report: ParityReport) -> None:
    """Prints the parity table and the int8/fp16 figures; exits non-zero when a bar is missed."""
    print(report.table())
    precision = manifest.precision
    for name in ("int8 vs fp32", "fp16 vs fp32"):
        if name in precision:
            p = precision[name]
            print(f"{name} (CPU): mean cosine {p['mean_cosine']:.5f}, worst row {p['worst_row_cosine']:.5f}")
    print(f"int8 build kept: {precision['int8_build']['chosen']}")
    if not report.passes():
        raise SystemExit("parity check failed: see the table above")
    if not precision["int8 vs fp32"]["passes"]:
        raise SystemExit("int8 model is below the 0.99 mean cosine bar against fp32")
