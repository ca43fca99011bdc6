"""Unit-length rows, shared by the backend's post step and the pipeline's shortened embeddings."""

from __future__ import annotations

import numpy as np


def l2_normalize(x: np.ndarray) -> np.ndarray:
    """(n, d) -> (n, d), each row divided by its length; an all-zero row stays zero."""
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.maximum(norms, 1e-12)
