"""The backend's stages (pad, run, unit rows) and the batcher's swap, which tests and fault injection use."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np

from contract.manifest import Manifest
from server.backend.ort import OnnxBackend, OnnxRuntime, RuntimeOptions
from server.core.batcher import Batcher, BatchPolicy


def backend(folder: Path) -> OnnxBackend:
    return OnnxBackend(OnnxRuntime(folder, RuntimeOptions(provider="cpu"), Manifest.read(folder).pad_id))


def test_the_stages_pad_run_and_append_unit_rows(tiny_artifacts: Path) -> None:
    model = backend(tiny_artifacts)
    rows = [np.array([2, 7, 9, 3]), np.array([2, 5, 3])]
    ids, mask = model.pre(rows)
    assert ids.shape == mask.shape == (2, 4) and mask.tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]
    assert ids[1, 3] == model.runtime.pad_id
    raw = model.run(ids, mask)
    out = model(rows)
    dim = raw.shape[1]
    assert out.shape == (2, 2 * dim)
    np.testing.assert_allclose(out[:, :dim], raw, rtol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(out[:, dim:], axis=1), 1.0, rtol=1e-5)
    np.testing.assert_allclose(out[:, dim:], raw / np.linalg.norm(raw, axis=1, keepdims=True), rtol=1e-5)


def test_a_swapped_backend_runs_the_next_batches_and_the_old_one_comes_back() -> None:
    calls: list[str] = []

    def first(rows):  # type: ignore[no-untyped-def]
        calls.append("first")
        return np.zeros((len(rows), 2), dtype=np.float32)

    def second(rows):  # type: ignore[no-untyped-def]
        calls.append("second")
        return np.ones((len(rows), 2), dtype=np.float32)

    async def run() -> None:
        batcher = Batcher(first, BatchPolicy(max_queue_tokens=1000))
        batcher.start()
        assert (await batcher.submit([np.array([1, 2])])).embeddings.tolist() == [[0.0, 0.0]]
        assert batcher.swap_backend(second) is first and batcher.backend is second
        assert (await batcher.submit([np.array([1, 2])])).embeddings.tolist() == [[1.0, 1.0]]
        await batcher.close()

    asyncio.run(run())
    assert calls == ["first", "second"]
