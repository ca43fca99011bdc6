"""What a batch runs on: the ONNX Runtime model in three stages, behind the batcher's ``Backend`` protocol.

pre: token id rows -> padded input_ids and attention_mask; run: the session (pooled rows, not normalised);
post: each row followed by its unit-length copy, (B, dim) -> (B, 2 x dim), so a request only picks the
half it asked for. Normalising a whole batch here, in the inference thread, costs about what normalising
one request costs on the event loop (numpy's per-call overhead dominates rows this small).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from server.runtime import OnnxRuntime, pad_rows


def l2_normalize(x: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.maximum(norms, 1e-12)


class OnnxBackend:
    """The served model as the batcher runs it: on its inference thread, or on the event loop for a short
    batch with nothing queued behind it (BatchPolicy.inline_batch_tokens)."""

    def __init__(self, runtime: OnnxRuntime) -> None:
        self.runtime = runtime

    def pre(self, rows: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        return pad_rows(rows, self.runtime.pad_id)

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        return self.runtime.run(input_ids, attention_mask)

    @staticmethod
    def post(embeddings: np.ndarray) -> np.ndarray:
        return np.concatenate([embeddings, l2_normalize(embeddings)], axis=1)

    def __call__(self, rows: Sequence[np.ndarray]) -> np.ndarray:
        return self.post(self.run(*self.pre(rows)))
