"""The ONNX Runtime backend: one InferenceSession, the provider that really loaded, warm-up.

Pre-processing (padding token id rows into numpy) and the core call (``session.run``) live here;
post-processing (normalisation) is the service's. Nothing here knows about gRPC or batching.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

log = logging.getLogger(__name__)

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"
MODEL_FILES = {"fp32": "model.onnx", "int8": "model.int8.onnx", "fp16": "model.fp16.onnx"}


class ModelNotFound(FileNotFoundError):
    pass


@dataclass(frozen=True)
class RuntimeOptions:
    provider: str = "auto"  # auto | cpu | cuda
    precision: str = "fp32"  # fp32 | int8 | fp16
    intra_op_threads: int = 0  # 0 = ONNX Runtime's default (one per physical core)
    inter_op_threads: int = 1
    spinning: bool = False  # let intra-op threads busy-wait between ops (see ServerConfig.intra_op_spinning)


def pad_rows(rows: Sequence[np.ndarray], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad int64 token id rows to the longest. Returns input_ids and attention_mask, (B, T)."""
    longest = max(len(r) for r in rows)
    ids = np.full((len(rows), longest), pad_id, dtype=np.int64)
    mask = np.zeros((len(rows), longest), dtype=np.int64)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = row
        mask[i, : len(row)] = 1
    return ids, mask


def _providers_for(option: str) -> list[str]:
    if option == "cpu":
        return [CPU]
    if option in ("auto", "cuda") and CUDA in ort.get_available_providers():
        return [CUDA, CPU]
    if option == "cuda":
        raise RuntimeError(f"--provider cuda asked, but this onnxruntime offers {ort.get_available_providers()}")
    return [CPU]


class OnnxRuntime:
    """Runs the exported encoder. ``run`` is thread-safe and releases the GIL while it computes."""

    def __init__(self, model_dir: Path | str, options: RuntimeOptions, pad_id: int) -> None:
        path = Path(model_dir) / MODEL_FILES[options.precision]
        if not path.is_file():
            raise ModelNotFound(f"{path} not found: run `make export` (or point --model-dir at the artifacts)")
        session_options = ort.SessionOptions()
        session_options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        session_options.intra_op_num_threads = options.intra_op_threads
        session_options.inter_op_num_threads = options.inter_op_threads
        session_options.log_severity_level = 3
        spin = "1" if options.spinning else "0"
        session_options.add_session_config_entry("session.intra_op.allow_spinning", spin)
        session_options.add_session_config_entry("session.inter_op.allow_spinning", spin)
        wanted = _providers_for(options.provider)
        # onnxruntime-gpu lists CUDA even where CUDA/cuDNN are missing; asking for it there logs a
        # screen of errors before falling back. Silence the probe; get_providers() tells the truth.
        ort.set_default_logger_severity(4)
        try:
            self.session = ort.InferenceSession(str(path), session_options, providers=wanted)
        finally:
            ort.set_default_logger_severity(2)
        self.providers: list[str] = self.session.get_providers()
        self.provider = self.providers[0]
        if options.provider == "cuda" and self.provider != CUDA:
            raise RuntimeError("--provider cuda asked, but the CUDA execution provider did not load (CUDA 13, cuDNN 9)")
        if CUDA in wanted and self.provider != CUDA:
            log.info("CUDA execution provider unavailable here; running on %s", self.provider)
        self.pad_id = pad_id
        self.precision = options.precision
        self.dim = int(self.session.get_outputs()[0].shape[1])
        self.model_path = path

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        """input_ids, attention_mask: int64 (B, T) -> float32 (B, dim), not normalised."""
        outputs = self.session.run(["embeddings"], {"input_ids": input_ids, "attention_mask": attention_mask})
        return np.asarray(outputs[0], dtype=np.float32)

    def run_rows(self, rows: Sequence[np.ndarray]) -> np.ndarray:
        return self.run(*pad_rows(rows, self.pad_id))

    def warm_up(self, max_len: int, max_batch_tokens: int, max_batch_size: int) -> None:
        """First runs allocate memory and pick kernels; pay for that before reporting SERVING.

        The largest batch the batcher can form is run too, so ONNX Runtime's memory arena reaches its
        peak now rather than at the first big batch under load (a latency spike and an RSS step).
        """
        largest = max(1, min(max_batch_size, max_batch_tokens // max_len))
        shapes = {(1, 2), (1, max_len), (8, max(2, max_len // 2)), (largest, max_len)}
        shapes.add((max(1, min(max_batch_size, max_batch_tokens // 2)), 2))
        for batch, length in sorted(shapes):
            ids = np.full((batch, length), self.pad_id + 1, dtype=np.int64)
            self.run(ids, np.ones_like(ids))
