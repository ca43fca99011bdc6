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

from server.backend.ort import (
    CAN_FLUSH_DENORMALS,
    OnnxRuntime,
    RuntimeOptions,
    batch_cost_line,
    flush_denormals_on_this_thread,
    pad_rows,
    rows_within,
)

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
    from server.backend import ort as runtime

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
    rng = np.random.default_rng(0)
    rows = [rng.integers(4, 60, size=n) for n in (3, 17, 9, 30)]
    ids, mask = pad_rows(rows, 0)
    cpu = OnnxRuntime(tiny_artifacts, RuntimeOptions(provider="cpu"), pad_id=0)
    cuda = OnnxRuntime(tiny_artifacts, RuntimeOptions(provider="cuda"), pad_id=0)
    assert cuda.providers[0] == "CUDAExecutionProvider"
    assert np.abs(cuda.run(ids, mask) - cpu.run(ids, mask)).max() <= 1e-4


def test_cuda_libraries_are_loaded_quietly_once_before_a_session_that_may_use_cuda(
    tiny_artifacts: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """CUDA and cuDNN from the nvidia-* wheels are on no library path: the runtime loads them itself
    (preload_dlls), once, and drops the lines preload_dlls prints where they are missing."""
    from server.backend import ort as runtime

    calls: list[int] = []

    def preload() -> None:
        calls.append(1)
        print("Failed to load libcublasLt.so.13: cannot open shared object file")

    monkeypatch.setattr(runtime.ort, "preload_dlls", preload)
    monkeypatch.setattr(runtime.ort, "get_available_providers", lambda: [runtime.CUDA, runtime.CPU])
    runtime.preload_cuda_libraries.cache_clear()
    try:
        OnnxRuntime(tiny_artifacts, RuntimeOptions(provider="cpu"), pad_id=0)
        assert calls == []  # --provider cpu never asks for CUDA
        for _ in range(2):
            OnnxRuntime(tiny_artifacts, RuntimeOptions(provider="auto"), pad_id=0)
        assert calls == [1]
        assert "Failed to load" not in capsys.readouterr().out
    finally:
        runtime.preload_cuda_libraries.cache_clear()


class RecordingSession:
    """An InferenceSession that counts its runs."""

    def __init__(self, session: object) -> None:
        self.session = session
        self.runs = 0

    def run(self, *args: object) -> object:
        self.runs += 1
        return self.session.run(*args)  # type: ignore[attr-defined]


def test_small_batches_run_on_the_one_thread_session_and_agree_with_the_threaded_one(tiny_artifacts: Path) -> None:
    runtime = OnnxRuntime(tiny_artifacts, RuntimeOptions(provider="cpu", intra_op_threads=2), pad_id=0)
    assert runtime.use_one_thread_up_to(8, max_len=16) == 8
    one, threaded = RecordingSession(runtime.one_thread_session), RecordingSession(runtime.session)
    runtime.one_thread_session, runtime.session = one, threaded  # type: ignore[assignment]
    small, large = np.full((2, 4), 5, dtype=np.int64), np.full((3, 4), 5, dtype=np.int64)  # 8 and 12 tokens
    on_one = runtime.run(small, np.ones_like(small))
    assert (one.runs, threaded.runs) == (1, 0)
    runtime.run(large, np.ones_like(large))
    assert (one.runs, threaded.runs) == (1, 1)
    runtime.one_thread_batch_tokens = 0
    np.testing.assert_allclose(runtime.run(small, np.ones_like(small)), on_one, atol=1e-6)
    assert (one.runs, threaded.runs) == (1, 2)


def test_no_second_session_when_off_on_one_thread_or_when_one_thread_is_never_faster(tiny_artifacts: Path) -> None:
    threaded = OnnxRuntime(tiny_artifacts, RuntimeOptions(provider="cpu", intra_op_threads=2), pad_id=0)
    assert threaded.use_one_thread_up_to(0, max_len=16) == 0 and threaded.one_thread_session is None
    single = OnnxRuntime(tiny_artifacts, RuntimeOptions(provider="cpu", intra_op_threads=1), pad_id=0)
    assert single.use_one_thread_up_to(-1, max_len=16) == 0 and single.one_thread_session is None
    measured = threaded.use_one_thread_up_to(-1, max_len=16)  # the ladder, cut at the model's 16 tokens
    assert measured in (0, 8, 16, 32, 64, 128, 256)
    assert (threaded.one_thread_session is None) == (measured == 0)


def test_beside_cuda_small_batches_run_on_a_one_thread_cpu_session(tiny_artifacts: Path) -> None:
    runtime = OnnxRuntime(tiny_artifacts, RuntimeOptions(provider="cpu", intra_op_threads=1), pad_id=0)
    runtime.provider = "CUDAExecutionProvider"  # as if the main session had loaded on a GPU
    assert runtime.use_one_thread_up_to(8, max_len=16) == 8  # a one-thread main session would take none on the CPU
    assert runtime.one_thread_session is not None
    assert runtime.one_thread_session.get_providers() == ["CPUExecutionProvider"]
    measured = runtime.use_one_thread_up_to(-1, max_len=16)  # the ladder against the main session
    assert measured in (0, 8, 16, 32, 64, 128, 256)
    assert (runtime.one_thread_session is None) == (measured == 0)


def test_the_one_thread_limit_is_the_last_size_of_the_first_run_where_one_thread_is_no_slower() -> None:
    from server.backend.ort import one_thread_limit

    sizes = [8, 16, 32, 64]
    assert one_thread_limit(sizes, [1.0, 1.0, 3.0, 1.0], [2.0, 1.0, 2.0, 2.0]) == 16  # stops at the first loss
    assert one_thread_limit(sizes, [3.0, 1.0, 1.0, 1.0], [2.0, 2.0, 2.0, 2.0]) == 0
    assert one_thread_limit(sizes, [1.0] * 4, [2.0] * 4) == 64


def test_the_batch_budget_fits_the_batch_it_returns_where_cost_per_token_grows_with_the_batch() -> None:
    def seconds(rows: int) -> float:  # 10 ms a row, a fifth more for every 10 rows
        return rows * 0.01 * (1 + rows / 50)

    rows = rows_within(0.5, 256, seconds)
    most = max(r for r in range(1, 257) if seconds(r) <= 0.5)  # 30
    assert seconds(rows) <= 0.5  # a guess from 8 rows alone (43) would take 0.80 s
    assert rows >= 0.8 * most
    assert rows_within(0.5, 12, seconds) == 12  # capped by the largest batch allowed
    assert rows_within(0.001, 256, seconds) == 1  # at least one row, however slow


def test_the_batch_cost_is_a_line_through_the_timed_batches() -> None:
    fixed, per_token = batch_cost_line([(1024, 0.002 + 1024 * 8e-6), (8192, 0.002 + 8192 * 8e-6), (4096, 0.034768)])
    assert fixed == pytest.approx(0.002, abs=1e-6) and per_token == pytest.approx(8e-6, rel=1e-3)
    assert batch_cost_line([(1000, 0.01), (1000, 0.02)]) == pytest.approx((0.0, 1.5e-5))  # one size: all per token
    assert batch_cost_line([(1000, 0.02), (2000, 0.03)])[0] == pytest.approx(0.01)
    assert batch_cost_line([(1000, 0.02), (2000, 0.05)]) == pytest.approx((0.0, 7e-5 / 3))  # no negative fixed part
    assert batch_cost_line([]) == (0.0, 0.0)


def test_the_longest_text_that_runs_within_a_time_alone_is_measured_up_to_the_models_length(
    tiny_artifacts: Path,
) -> None:
    runtime = OnnxRuntime(tiny_artifacts, RuntimeOptions(provider="cpu"), pad_id=0)
    assert runtime.tokens_within_alone(10.0, max_len=16) == 16  # 8, then 16: the model's length
    assert runtime.tokens_within_alone(1e-9, max_len=16) == 0  # not even 8 tokens
    assert runtime.tokens_within_alone(0.0, max_len=16) == 0  # off
    runtime.provider = "CUDAExecutionProvider"
    assert runtime.tokens_within_alone(10.0, max_len=16) == 0  # never a text that runs on the GPU
    runtime.use_one_thread_up_to(8, max_len=16)
    assert runtime.tokens_within_alone(10.0, max_len=16) == 8  # only what the one-thread CPU session takes


def with_cpu_graph(tiny_artifacts: Path, folder: Path) -> Path:
    """tiny_artifacts plus a model.cpu.onnx with other weights, so each output says which graph ran it."""
    import onnx

    from tests.onnx_tiny import encoder_graph

    shutil.copytree(tiny_artifacts, folder, dirs_exist_ok=True)
    plain = onnx.load(folder / "model.onnx")
    vocab, dim = (int(d) for d in onnx.numpy_helper.to_array(plain.graph.initializer[0]).shape)
    onnx.save(encoder_graph(vocab, dim, seed=7), folder / "model.cpu.onnx")
    return folder


def outputs_of(path: Path, ids: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return np.asarray(session.run(["embeddings"], {"input_ids": ids, "attention_mask": np.ones_like(ids)})[0])


def test_cpu_sessions_run_the_cpu_graph_where_the_folder_has_one(tiny_artifacts: Path, tmp_path: Path) -> None:
    folder = with_cpu_graph(tiny_artifacts, tmp_path / "model")
    ids = np.array([[5, 6, 7, 8], [9, 10, 11, 12]], dtype=np.int64)
    fused, plain = outputs_of(folder / "model.cpu.onnx", ids), outputs_of(folder / "model.onnx", ids)
    assert np.abs(fused - plain).max() > 1e-3  # the two graphs tell themselves apart
    for provider in ("cpu", "auto"):  # auto: CUDA asked for first; where it does not load, the CPU graph
        runtime = OnnxRuntime(folder, RuntimeOptions(provider=provider, intra_op_threads=2), pad_id=0)
        expected = fused if runtime.provider == "CPUExecutionProvider" else plain
        np.testing.assert_allclose(runtime.run(ids, np.ones_like(ids)), expected, atol=1e-6)
        assert runtime.use_one_thread_up_to(8, max_len=16) == 8  # the small batch below runs there
        np.testing.assert_allclose(runtime.run(ids, np.ones_like(ids)), fused, atol=1e-6)
    int8 = OnnxRuntime(folder, RuntimeOptions(provider="cpu", precision="int8"), pad_id=0)
    assert int8.model_path.name == int8.cpu_model_path.name == "model.int8.onnx"  # fp32 only
    without = OnnxRuntime(tiny_artifacts, RuntimeOptions(provider="cpu"), pad_id=0)
    assert without.model_path.name == without.cpu_model_path.name == "model.onnx"
    np.testing.assert_allclose(without.run(ids, np.ones_like(ids)), plain, atol=1e-6)


def test_cpu_sessions_go_without_the_skip_layer_norm_fusion(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ONNX Runtime's CPU SkipLayerNormalization kernel ran both exported models slower than the residual Add and
    the LayerNormalization it replaces (decisions/0027); a session that may run on CUDA keeps the fusion."""
    from server.backend import ort as runtime
    from tests.onnx_tiny import optimized_op_types, residual_then_norm

    graph, written = residual_then_norm(tmp_path / "graph.onnx"), tmp_path / "optimized.onnx"

    def ops_on(providers: list) -> list[str]:  # type: ignore[type-arg]
        return optimized_op_types(
            monkeypatch, written, runtime, lambda: runtime._open_session(graph, RuntimeOptions(), 1, providers)
        )

    assert ops_on([runtime.CPU]) == ["Add", "LayerNormalization"]
    assert ops_on([(runtime.CUDA, runtime.CUDA_OPTIONS), runtime.CPU]) == ["SkipLayerNormalization"]
