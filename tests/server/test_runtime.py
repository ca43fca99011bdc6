"""The ONNX Runtime backend: the floating-point mode of the threads that call it."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import numpy as np
import pytest

from server.runtime import CAN_FLUSH_DENORMALS, OnnxRuntime, RuntimeOptions, flush_denormals_on_this_thread, pad_rows

T = TypeVar("T")


def denormals_survive() -> bool:
    return bool(np.float32(1e-38) * np.float32(1e-2) != 0)  # 1e-40 is a denormal float32


def on_a_new_thread(work: Callable[[], T]) -> T:
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(work).result()


@pytest.mark.skipif(not CAN_FLUSH_DENORMALS, reason="FTZ and DAZ are set through x86-64's MXCSR register")
def test_the_flag_can_be_turned_on_and_off_on_one_thread() -> None:
    def switch() -> tuple[bool, bool]:
        assert flush_denormals_on_this_thread(on=False)
        off = denormals_survive()
        assert flush_denormals_on_this_thread(on=True)
        return off, denormals_survive()

    assert on_a_new_thread(switch) == (True, False)


@pytest.mark.skipif(not CAN_FLUSH_DENORMALS, reason="FTZ and DAZ are set through x86-64's MXCSR register")
def test_run_flushes_denormals_on_the_thread_that_calls_it(tiny_artifacts: Path) -> None:
    """The calling thread computes its share of every operator: without FTZ/DAZ there, ONNX Runtime's
    Softmax over padded keys (scores near -1e4, exp() underflowing through denormals) ran 14x slower."""
    runtime = OnnxRuntime(tiny_artifacts, RuntimeOptions(provider="cpu"), pad_id=0)
    ids, mask = pad_rows([np.array([2, 50, 60, 3]), np.array([2, 70, 3])], pad_id=0)

    def first_run_on_a_fresh_thread() -> tuple[bool, bool]:
        assert flush_denormals_on_this_thread(on=False)  # whatever the thread inherited
        before = denormals_survive()
        runtime.run(ids, mask)
        return before, denormals_survive()

    assert on_a_new_thread(first_run_on_a_fresh_thread) == (True, False)


def test_cuda_is_asked_for_true_fp32(monkeypatch: pytest.MonkeyPatch) -> None:
    """ONNX Runtime's CUDA provider defaults to TF32 matrix products: 8e-4 off the CPU's embeddings on an
    H100, eight times the parity bar. The provider must be asked with TF32 off."""
    from server import runtime

    monkeypatch.setattr(runtime.ort, "get_available_providers", lambda: [runtime.CUDA, runtime.CPU])
    for option in ("auto", "cuda"):
        assert runtime._providers_for(option) == [(runtime.CUDA, {"use_tf32": "0"}), runtime.CPU]
    assert runtime._providers_for("cpu") == [runtime.CPU]


def a_gpu_is_here() -> bool:
    smi = shutil.which("nvidia-smi")
    return smi is not None and subprocess.run([smi, "-L"], capture_output=True).returncode == 0


@pytest.mark.skipif(not a_gpu_is_here(), reason="needs an NVIDIA GPU (nvidia-smi lists none here)")
def test_cuda_fp32_equals_the_cpu(tiny_artifacts: Path) -> None:
    """On a GPU machine with CUDA 13 and cuDNN 9 (`make gpu-check` installs them): the CUDA provider really
    loads, and its fp32 embeddings are the CPU's within 1e-4."""
    import onnxruntime as ort

    if hasattr(ort, "preload_dlls"):
        ort.preload_dlls()
    rng = np.random.default_rng(0)
    rows = [rng.integers(4, 60, size=n) for n in (3, 17, 9, 30)]
    ids, mask = pad_rows(rows, 0)
    cpu = OnnxRuntime(tiny_artifacts, RuntimeOptions(provider="cpu"), pad_id=0)
    cuda = OnnxRuntime(tiny_artifacts, RuntimeOptions(provider="cuda"), pad_id=0)
    assert cuda.providers[0] == "CUDAExecutionProvider"
    assert np.abs(cuda.run(ids, mask) - cpu.run(ids, mask)).max() <= 1e-4
