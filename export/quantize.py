"""Faster model variants: int8 (ONNX Runtime dynamic quantization) and fp16 (for CUDA).

For int8, two candidates are built and timed on this machine: quantizing the exported graph as is,
and quantizing it after ONNX Runtime's transformer optimizer. The faster one is kept (the choice and
both timings go into the manifest).
"""

from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnxruntime.quantization import QuantType, quant_pre_process, quantize_dynamic

INT8_FILE = "model.int8.onnx"
FP16_FILE = "model.fp16.onnx"
TIMING_BATCH, TIMING_SEQUENCE = 32, 48  # the batch shape the two int8 candidates are timed on


def _session(path: Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def time_model(
    path: Path,
    batch: int = TIMING_BATCH,
    sequence: int = TIMING_SEQUENCE,
    repeats: int = 20,
    seed: int = 0,
    vocab_size: int = 1000,
) -> float:
    """Median seconds per batch on the CPU for a random batch of the given shape."""
    session = _session(path)
    rng = np.random.default_rng(seed)
    ids = rng.integers(4, min(1000, vocab_size), size=(batch, sequence), dtype=np.int64)
    mask = np.ones_like(ids)
    feed = {"input_ids": ids, "attention_mask": mask}
    for _ in range(3):
        session.run(None, feed)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        session.run(None, feed)
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def _optimize(fp32: Path, out: Path, num_heads: int, hidden_size: int) -> Path:
    from onnxruntime.transformers.optimizer import optimize_model

    logging.getLogger("onnxruntime.transformers").setLevel(logging.ERROR)
    optimized = optimize_model(str(fp32), model_type="bert", num_heads=num_heads, hidden_size=hidden_size)
    optimized.save_model_to_file(str(out))
    return out


def _quantize(source: Path, out: Path) -> Path:
    with tempfile.TemporaryDirectory() as tmp:
        prepared = Path(tmp) / "prepared.onnx"
        quant_pre_process(str(source), str(prepared), skip_symbolic_shape=True)
        # Per-channel weight scales: all-MiniLM-L6-v2 kept mean cosine 0.991 to fp32 on real sentences with them
        # and 0.959 with one scale per tensor (reduce_range: 0.886), at the same speed on our models.
        quantize_dynamic(str(prepared), str(out), weight_type=QuantType.QInt8, per_channel=True)
    return out


def export_int8(
    model_dir: Path, num_heads: int, hidden_size: int, max_len: int, vocab_size: int = 1000
) -> dict[str, object]:
    sequence = min(TIMING_SEQUENCE, max_len)
    fp32 = model_dir / "model.onnx"
    with tempfile.TemporaryDirectory() as tmp:
        tmp_dir = Path(tmp)
        candidates = {"quantized": _quantize(fp32, tmp_dir / "plain.int8.onnx")}
        try:
            optimized = _optimize(fp32, tmp_dir / "optimized.onnx", num_heads, hidden_size)
            candidates["optimized+quantized"] = _quantize(optimized, tmp_dir / "optimized.int8.onnx")
        except Exception as e:  # the optimizer is best-effort; the plain quantized model always works
            logging.getLogger(__name__).warning("transformer optimizer failed (%s); using plain quantization", e)
        timings = {
            name: time_model(path, sequence=sequence, vocab_size=vocab_size) for name, path in candidates.items()
        }
        chosen = min(timings, key=lambda name: timings[name])
        (model_dir / INT8_FILE).write_bytes(candidates[chosen].read_bytes())
    return {
        "chosen": chosen,
        "timed_batch": [TIMING_BATCH, sequence],
        "seconds_per_batch": timings,
        "fp32_seconds_per_batch": time_model(fp32, sequence=sequence, vocab_size=vocab_size),
    }


def export_fp16(model_dir: Path) -> None:
    from onnxruntime.transformers.float16 import convert_float_to_float16

    model = onnx.load(str(model_dir / "model.onnx"))
    # keep_io_types: int64 ids in, float32 embeddings out, so clients and the server see no difference.
    converted = convert_float_to_float16(model, keep_io_types=True)
    onnx.save(converted, str(model_dir / FP16_FILE))
