"""Faster model variants: int8 (ONNX Runtime dynamic quantization) and fp16 (for CUDA).

Four int8 candidates are built (per-channel int8, per-tensor int8, per-channel uint8 weights, and the
transformer optimizer's graph per channel), timed as the server runs them and compared with fp32. Of those
that meet the cosine bar the fastest is kept, or the most accurate within 10% of its speed (decisions/0012,
0028); if none meets it, the most accurate, and the export reports the miss. The choice, timings and
cosines go into the manifest; the optimizer's graph is also written as the distillation teacher's build.
"""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
from onnxruntime.quantization import QuantType, quant_pre_process, quantize_dynamic
from tqdm import tqdm

from contract.manifest import CPU_DISABLED_OPTIMIZERS, MODEL_FILES, TEACHER_FILE, cpu_model_path
from export.verify import INT8_MEAN_COSINE_BAR, ReferenceBatch, cpu_session, row_cosines_against_fp32

INT8_FILE = MODEL_FILES["int8"]
FP16_FILE = MODEL_FILES["fp16"]
# The build written as TEACHER_FILE, whatever the timing keeps: the distillation teacher's targets (and the student's
# figures on them) must not follow a serving setting or one machine's timing (docs/decisions/0028). The plain graph,
# per channel, where the optimizer fails.
TEACHER_BUILD, TEACHER_FALLBACK = "optimized+quantized", "quantized"
TIMING_BATCH, TIMING_SEQUENCE = 32, 48  # the batch shape the int8 candidates are timed on
# Candidates this close in speed are a tie, decided by accuracy: a choice by timing noise would change the
# served int8 model from one export of the same weights to the next (decisions/0012).
SAME_SPEED = 0.10


def time_models(
    paths: dict[str, Path],
    batch: int = TIMING_BATCH,
    sequence: int = TIMING_SEQUENCE,
    repeats: int = 10,
    seed: int = 0,
    vocab_size: int = 1000,
) -> dict[str, float]:
    """Median seconds per batch on the CPU of each model, for one random batch of the given shape. The
    models take turns, one timed run each per round: a slow spell of the machine then slows every model
    alike instead of the one timed during it. Each turn times a model's second run, its weights back in
    the caches as when it serves alone. Each session is opened as the server opens a CPU session (without the
    fusions it leaves out, docs/decisions/0027): the build kept is the fastest as served."""
    sessions = {name: cpu_session(path, CPU_DISABLED_OPTIMIZERS) for name, path in paths.items()}
    rng = np.random.default_rng(seed)
    ids = rng.integers(4, min(1000, vocab_size), size=(batch, sequence), dtype=np.int64)
    feed = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    for session in sessions.values():
        for _ in range(3):
            session.run(None, feed)
    times: dict[str, list[float]] = {name: [] for name in sessions}
    for _ in tqdm(range(repeats), desc=f"timing {len(sessions)} builds", unit="round", mininterval=1.0, leave=False):
        for name, session in sessions.items():
            session.run(None, feed)
            start = time.perf_counter()
            session.run(None, feed)
            times[name].append(time.perf_counter() - start)
    return {name: float(np.median(seconds)) for name, seconds in times.items()}


def _optimize(fp32: Path, out: Path, num_heads: int, hidden_size: int) -> Path:
    from onnxruntime.transformers.optimizer import optimize_model

    logging.getLogger("onnxruntime.transformers").setLevel(logging.ERROR)
    optimized = optimize_model(str(fp32), model_type="bert", num_heads=num_heads, hidden_size=hidden_size)
    optimized.save_model_to_file(str(out))
    return out


def _prepare(source: Path, out: Path) -> Path:
    """The graph quantize_dynamic is given: ONNX Runtime's pre-processing (shape inference, constant
    folding), once per graph for all the candidates quantized from it."""
    quant_pre_process(str(source), str(out), skip_symbolic_shape=True)
    return out


def _quantize(prepared: Path, out: Path, per_channel: bool = True, weight_type: QuantType = QuantType.QInt8) -> Path:
    quantize_dynamic(str(prepared), str(out), weight_type=weight_type, per_channel=per_channel)
    return out


def choose_int8(
    seconds: dict[str, float],
    mean_cosines: dict[str, float],
    bar: float = INT8_MEAN_COSINE_BAR,
    tie: float = SAME_SPEED,
) -> str:
    """Of the candidates that meet the accuracy bar, those within `tie` of the fastest count as equally
    fast and the most accurate of them is kept; when none meets the bar, the most accurate."""
    accurate = [name for name in seconds if mean_cosines[name] >= bar]
    if not accurate:
        return max(mean_cosines, key=lambda name: mean_cosines[name])
    fastest = min(seconds[name] for name in accurate)
    equally_fast = [name for name in accurate if seconds[name] <= fastest * (1 + tie)]
    return max(equally_fast, key=lambda name: mean_cosines[name])


def export_int8(
    model_dir: Path,
    num_heads: int,
    hidden_size: int,
    max_len: int,
    reference: Sequence[ReferenceBatch],
    vocab_size: int = 1000,
    compare_also: dict[str, Path] | None = None,
) -> tuple[dict[str, object], dict[str, np.ndarray]]:
    """Builds, times and compares the int8 candidates with fp32's embeddings of the reference batches (the
    parity's); writes the one chosen, and the teacher build as TEACHER_FILE. Returns the choice's figures and
    each row's cosine to fp32 for the kept int8 build and for every build in compare_also."""
    assert reference, "no fp32 outputs to compare the builds with: the parity check keeps them"
    sequence = min(TIMING_SEQUENCE, max_len)
    fp32 = model_dir / MODEL_FILES["fp32"]  # the transformer optimizer's input
    # The graph the server runs fp32 on the CPU: timed against, and quantized from. Its fused attention blocks
    # quantize to ONNX Runtime's QAttention (the same products, cosines to fp32 equal to the plain graph's).
    served_fp32 = cpu_model_path(model_dir, "fp32")
    compare_also = compare_also or {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp_dir = Path(tmp)
        print("int8 builds: per channel, per tensor, uint8 weights, optimized graph", flush=True)
        prepared = _prepare(served_fp32, tmp_dir / "prepared.onnx")
        candidates = {
            "quantized": _quantize(prepared, tmp_dir / "plain.int8.onnx"),
            "quantized per tensor": _quantize(prepared, tmp_dir / "per-tensor.int8.onnx", per_channel=False),
            # Unsigned weights: x86 CPUs without VNNI multiply uint8 activations by int8 weights in int16
            # pairs that can saturate; uint8 x uint8 takes another kernel that does not.
            "quantized u8 weights": _quantize(prepared, tmp_dir / "u8.int8.onnx", weight_type=QuantType.QUInt8),
        }
        try:
            optimized = _optimize(fp32, tmp_dir / "optimized.onnx", num_heads, hidden_size)
            optimized_prepared = _prepare(optimized, tmp_dir / "optimized.prepared.onnx")
            candidates["optimized+quantized"] = _quantize(optimized_prepared, tmp_dir / "optimized.int8.onnx")
        except Exception as e:  # the optimizer is best-effort; the plain quantized model always works
            logging.getLogger(__name__).warning("transformer optimizer failed (%s); using plain quantization", e)
        timings = time_models({**candidates, "fp32": served_fp32}, sequence=sequence, vocab_size=vocab_size)
        fp32_seconds = timings.pop("fp32")
        builds = {**candidates, **compare_also}
        compared = row_cosines_against_fp32(reference, list(builds.values()))
        rows = dict(zip(builds, compared, strict=True))
        cosines = {name: float(rows[name].mean()) for name in candidates}
        chosen = choose_int8(timings, cosines)
        (model_dir / INT8_FILE).write_bytes(candidates[chosen].read_bytes())
        teacher = TEACHER_BUILD if TEACHER_BUILD in candidates else TEACHER_FALLBACK
        (model_dir / TEACHER_FILE).write_bytes(candidates[teacher].read_bytes())
    choice = {
        "chosen": chosen,
        "teacher": teacher,
        "timed_batch": [TIMING_BATCH, sequence],
        "seconds_per_batch": timings,
        "mean_cosine": cosines,
        "fp32_seconds_per_batch": fp32_seconds,
    }
    return choice, {"int8": rows[chosen], **{name: rows[name] for name in compare_also}}


def export_fp16(model_dir: Path) -> None:
    from onnxruntime.transformers.float16 import convert_float_to_float16

    model = onnx.load(str(model_dir / "model.onnx"))
    # keep_io_types: int64 ids in, float32 embeddings out, so clients and the server see no difference.
    converted = convert_float_to_float16(model, keep_io_types=True)
    onnx.save(converted, str(model_dir / FP16_FILE))
