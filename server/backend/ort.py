"""The ONNX Runtime backend: sessions, the provider that really loaded, warm-up, and the stages a batch runs in.

pre pads token id rows into numpy; run calls the session (pooled rows, not normalised); post puts each row
beside its unit-length copy, (B, dim) -> (B, 2 x dim), so a request picks the half it asked for. Small
batches may run on a second, one-thread CPU session, where a threaded session's fork and join (or, on
CUDA, a GPU run's fixed cost) costs more than it saves; how small is measured at warm-up
(decisions/0011). Nothing here knows a protocol or the batcher.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import io
import logging
import os
import platform
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from contract.manifest import CPU_DISABLED_OPTIMIZERS, MODEL_FILES, cpu_model_path
from server.core.normalize import l2_normalize

log = logging.getLogger(__name__)

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"


class ModelNotFound(FileNotFoundError):
    pass


class ProviderUnavailable(RuntimeError):
    """The execution provider asked for explicitly (--provider cuda) does not load on this machine."""


@dataclass(frozen=True)
class RuntimeOptions:
    provider: str = "auto"  # auto | cpu | cuda
    precision: str = "fp32"  # fp32 | int8 | fp16
    intra_op_threads: int = 0  # 0 = ONNX Runtime's default (one per physical core)
    inter_op_threads: int = 1
    spinning: bool = False  # let intra-op threads busy-wait between ops (see ServerConfig.intra_op_spinning)


# Batch shapes (rows, tokens) timed on one thread and on the session's threads: padded tokens double each step.
ONE_THREAD_LADDER = ((1, 8), (1, 16), (1, 32), (1, 64), (1, 128), (2, 128), (4, 128), (8, 128), (16, 128))
ONE_THREAD_RUNS = 7  # timed runs per shape and session, interleaved; their medians are compared


def one_thread_limit(sizes: Sequence[int], one_thread: Sequence[float], threaded: Sequence[float]) -> int:
    """The most padded tokens up to which one thread was no slower, at every size up to it (0: not even the
    smallest). Sizes ascend; times are per size, in seconds."""
    limit = 0
    for size, one, many in zip(sizes, one_thread, threaded, strict=True):
        if one > many:
            break
        limit = size
    return limit


def rows_within(seconds: float, max_rows: int, time_rows: Callable[[int], float]) -> int:
    """The most rows, 1 to max_rows, whose batch ``time_rows`` measures within ``seconds``. A guess from 8
    rows, then checked at its own size and shrunk in proportion until it fits (a few tries): on a CPU the
    cost per token grows with the batch, so a guess from a small batch alone errs long."""
    rows = min(8, max_rows)
    guess = max(1, min(max_rows, int(rows * seconds / max(time_rows(rows), 1e-9))))
    for _ in range(3):
        took = time_rows(guess)
        if took <= seconds or guess == 1:
            break
        guess = max(1, int(guess * seconds / took))
    return guess


def batch_cost_line(times: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares (fixed seconds, seconds per token) through (padded tokens, seconds) readings; the
    fixed part never below 0. One size alone: all of it per token."""
    if not times:
        return 0.0, 0.0
    tokens = np.array([t for t, _ in times], dtype=np.float64)
    seconds = np.array([s for _, s in times], dtype=np.float64)
    if len(set(tokens.tolist())) < 2:
        return 0.0, float(seconds.sum() / tokens.sum())
    per_token, fixed = np.polyfit(tokens, seconds, 1)
    if fixed < 0 or per_token <= 0:
        return 0.0, float(seconds.sum() / tokens.sum())
    return float(fixed), float(per_token)


def pad_rows(rows: Sequence[np.ndarray], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad int64 token id rows to the longest. Returns input_ids and attention_mask, (B, T)."""
    longest = max(len(r) for r in rows)
    ids = np.full((len(rows), longest), pad_id, dtype=np.int64)
    mask = np.zeros((len(rows), longest), dtype=np.int64)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = row
        mask[i, : len(row)] = 1
    return ids, mask


class _FloatEnvironment(ctypes.Structure):
    """glibc's fenv_t on x86-64: the x87 environment (28 bytes), then the SSE control register MXCSR."""

    _fields_ = [("x87", ctypes.c_uint8 * 28), ("mxcsr", ctypes.c_uint32)]


MXCSR_DAZ = 1 << 6  # denormal inputs read as zero
MXCSR_FTZ = 1 << 15  # results that would be denormal are flushed to zero
MXCSR_EXCEPTION_MASKS = 0x1F80  # set in every thread's default MXCSR: a check that the layout is right
CAN_FLUSH_DENORMALS = sys.platform == "linux" and platform.machine() in ("x86_64", "AMD64")
_threads = threading.local()


@functools.cache
def _libm() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")


def flush_denormals_on_this_thread(on: bool = True) -> bool:
    """Turns FTZ and DAZ on (or off) for the calling thread (x86-64 Linux); returns whether that was done.

    Attention gives padded keys a score near -1e4, and exp() of it underflows through denormal floats,
    which x86 cores handle in microcode, many times slower (decisions/0003). ``session.set_denormal_as_zero``
    turns FTZ/DAZ on in ONNX Runtime's pool threads (and in whichever thread creates the process's first
    session), not in the thread that calls ``run``, which computes its share of every operator. Values that
    small are zero for an embedding.
    """
    if not CAN_FLUSH_DENORMALS:
        return False
    libm = _libm()
    environment = _FloatEnvironment()
    if libm.fegetenv(ctypes.byref(environment)) != 0:
        return False
    if environment.mxcsr & MXCSR_EXCEPTION_MASKS != MXCSR_EXCEPTION_MASKS:
        return False  # not the layout this expects: leave the thread as it is
    if on:
        environment.mxcsr |= MXCSR_DAZ | MXCSR_FTZ
    else:
        environment.mxcsr &= ~(MXCSR_DAZ | MXCSR_FTZ) & 0xFFFFFFFF
    return bool(libm.fesetenv(ctypes.byref(environment)) == 0)


# ONNX Runtime's CUDA provider computes fp32 matrix products in TF32 by default (10-bit mantissa), off the
# CPU's embeddings. fp32 here means fp32; fp16 is the fast precision on a GPU (decisions/0007).
CUDA_OPTIONS = {"use_tf32": "0"}


@functools.cache
def preload_cuda_libraries() -> None:
    """Load CUDA 13 and cuDNN 9 from the nvidia-* wheels (the project's ``cuda`` extra, which ``make setup``
    adds where nvidia-smi lists a GPU), which sit on no library path: ONNX Runtime's CUDA provider finds them
    only when they are loaded first (or named in LD_LIBRARY_PATH). Where they are missing, preload_dlls
    prints a line per library; the session's get_providers() says afterwards whether CUDA loaded, so
    those lines are dropped. Once per process."""
    if hasattr(ort, "preload_dlls"):
        with contextlib.redirect_stdout(io.StringIO()):
            ort.preload_dlls()


def _providers_for(option: str) -> list[str | tuple[str, dict[str, str]]]:
    if option == "cpu":
        return [CPU]
    if option in ("auto", "cuda") and CUDA in ort.get_available_providers():
        preload_cuda_libraries()
        return [(CUDA, CUDA_OPTIONS), CPU]
    if option == "cuda":
        raise RuntimeError(f"--provider cuda asked, but this onnxruntime offers {ort.get_available_providers()}")
    return [CPU]


def _open_session(
    path: Path, options: RuntimeOptions, threads: int, providers: list[str | tuple[str, dict[str, str]]]
) -> ort.InferenceSession:
    session_options = ort.SessionOptions()
    session_options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    session_options.intra_op_num_threads = threads
    session_options.inter_op_num_threads = options.inter_op_threads
    session_options.log_severity_level = 3
    spin = "1" if options.spinning else "0"
    session_options.add_session_config_entry("session.intra_op.allow_spinning", spin)
    session_options.add_session_config_entry("session.inter_op.allow_spinning", spin)
    session_options.add_session_config_entry("session.set_denormal_as_zero", "1")
    disabled = list(CPU_DISABLED_OPTIMIZERS) if providers == [CPU] else []
    return ort.InferenceSession(str(path), session_options, providers=providers, disabled_optimizers=disabled)


class OnnxRuntime:
    """Runs the exported encoder. ``run`` is thread-safe and releases the GIL while it computes."""

    def __init__(self, model_dir: Path | str, options: RuntimeOptions, pad_id: int) -> None:
        path = Path(model_dir) / MODEL_FILES[options.precision]
        if not path.is_file():
            raise ModelNotFound(f"{path} not found: run `make export` (or point --model-dir at the artifacts)")
        self.cpu_model_path = cpu_model_path(Path(model_dir), options.precision)
        wanted = _providers_for(options.provider)
        # onnxruntime-gpu lists CUDA even where CUDA/cuDNN are missing; asking for it there logs a
        # screen of errors before falling back. Silence the probe; get_providers() tells the truth.
        ort.set_default_logger_severity(4)
        self.model_path = self.cpu_model_path if wanted == [CPU] else path  # the graph the main session runs
        try:
            self.session = _open_session(self.model_path, options, options.intra_op_threads, wanted)
        finally:
            ort.set_default_logger_severity(2)
        self.providers: list[str] = self.session.get_providers()
        self.provider = self.providers[0]
        if options.provider == "cuda" and self.provider != CUDA:
            raise ProviderUnavailable(
                "--provider cuda asked, but the CUDA execution provider did not load (it needs CUDA 13 and cuDNN 9)"
            )
        if wanted != [CPU] and self.provider != CUDA:  # CUDA was asked for (auto) and did not load
            log.info("CUDA execution provider unavailable here; running on %s", self.provider)
            # Opened again as a session for the CPU alone: its graph, without the fusions CPU sessions leave out.
            self.model_path = self.cpu_model_path
            self.session = _open_session(self.model_path, options, options.intra_op_threads, [CPU])
        self.pad_id = pad_id
        self.precision = options.precision
        self.dim = int(self.session.get_outputs()[0].shape[1])
        self.options = options
        self.one_thread_session: ort.InferenceSession | None = None
        self.one_thread_batch_tokens = 0  # batches of at most this many padded tokens run on one thread
        self.batch_times: list[tuple[int, float]] = []  # (padded tokens, seconds) timed by batch_tokens_within

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        """input_ids, attention_mask: int64 (B, T) -> float32 (B, dim), not normalised."""
        if not hasattr(_threads, "flushing_denormals"):  # once per calling thread
            _threads.flushing_denormals = flush_denormals_on_this_thread()
            if not _threads.flushing_denormals:
                log.info("denormal floats are not flushed to zero on this platform (%s)", platform.machine())
        small = self.one_thread_session is not None and input_ids.size <= self.one_thread_batch_tokens
        session = self.one_thread_session if small else self.session
        outputs = session.run(["embeddings"], {"input_ids": input_ids, "attention_mask": attention_mask})  # type: ignore[union-attr]
        return np.asarray(outputs[0], dtype=np.float32)

    def run_rows(self, rows: Sequence[np.ndarray]) -> np.ndarray:
        return self.run(*pad_rows(rows, self.pad_id))

    def use_one_thread_up_to(self, tokens: int, max_len: int) -> int:
        """Run batches of at most ``tokens`` padded tokens on a second, one-thread CPU session; -1 measures how
        many (``one_thread_limit`` over ``ONE_THREAD_LADDER``, both sessions warmed up first), 0 runs every
        batch on the main session. On the CPU where the main session has more than one thread, and beside
        CUDA. Returns the limit now in force.
        """
        threads = self.options.intra_op_threads or os.cpu_count() or 1
        if tokens == 0 or (self.provider == CPU and threads == 1):
            self.one_thread_session, self.one_thread_batch_tokens = None, 0
            return 0
        self.one_thread_session = _open_session(self.cpu_model_path, self.options, 1, [CPU])
        if tokens < 0:
            tokens = self._measure_one_thread_limit(max_len)
        self.one_thread_batch_tokens = tokens
        if not tokens:
            self.one_thread_session = None  # its memory back
        return tokens

    def _measure_one_thread_limit(self, max_len: int) -> int:
        shapes = sorted({(rows, min(length, max_len)) for rows, length in ONE_THREAD_LADDER}, key=lambda s: s[0] * s[1])
        timed: dict[str, list[float]] = {"one": [], "threaded": []}
        for rows, length in shapes:
            ids = np.full((rows, length), self.pad_id + 1, dtype=np.int64)
            feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
            seconds: dict[str, list[float]] = {"one": [], "threaded": []}
            for _ in range(ONE_THREAD_RUNS + 1):  # the first run of each shape pays for its memory: not counted
                for name, session in (("one", self.one_thread_session), ("threaded", self.session)):
                    started = time.perf_counter()
                    session.run(["embeddings"], feeds)  # type: ignore[union-attr]
                    seconds[name].append(time.perf_counter() - started)
            for name, values in seconds.items():
                timed[name].append(float(np.median(values[1:])))
            if timed["one"][-1] > timed["threaded"][-1]:
                break  # one_thread_limit stops here too: larger shapes would not be used
        sizes = [rows * length for rows, length in shapes][: len(timed["one"])]
        return one_thread_limit(sizes, timed["one"], timed["threaded"])

    def batch_tokens_within(self, seconds: float, max_len: int, max_batch_tokens: int) -> int:
        """The most padded tokens, in whole rows of ``max_len``, that one batch computes within ``seconds``
        (``rows_within``, each shape's time the median of three runs after one that pays for its memory).
        ``max_batch_tokens`` is the most it returns, ``max_len`` the least.
        """

        def time_rows(rows: int) -> float:
            self.batch_times.append((rows * max_len, self._median_run_seconds(rows, max_len, runs=3)))
            return self.batch_times[-1][1]

        return rows_within(seconds, max(1, max_batch_tokens // max_len), time_rows) * max_len

    def tokens_within_alone(self, seconds: float, max_len: int) -> int:
        """The most padded tokens of one text, 8, 16, 32, ... up to ``max_len``, whose run measured within
        ``seconds`` (median of ONE_THREAD_RUNS); 0: not even 8. Only texts that run on the CPU (beside CUDA,
        those the one-thread session takes): a CPU run this short stalls only if the whole machine does,
        while a GPU call can hang on its driver, and the caller runs these texts on the event loop
        (decisions/0015)."""
        on_cpu = max_len if self.provider == CPU else self.one_thread_batch_tokens
        if seconds <= 0 or on_cpu <= 0:
            return 0
        doubling = [8 << k for k in range(max_len.bit_length()) if 8 << k < max_len] + [max_len]
        lengths = [length for length in doubling if length <= on_cpu]
        limit = 0
        for length in lengths:
            if self._median_run_seconds(1, length, runs=ONE_THREAD_RUNS) > seconds:
                break
            limit = length
        return limit

    def _median_run_seconds(self, rows: int, length: int, runs: int) -> float:
        """Median seconds of ``runs`` runs of a (rows, length) batch, after one that pays for its memory."""
        ids = np.full((rows, length), self.pad_id + 1, dtype=np.int64)
        mask = np.ones_like(ids)
        self.run(ids, mask)
        seconds = []
        for _ in range(runs):
            started = time.perf_counter()
            self.run(ids, mask)
            seconds.append(time.perf_counter() - started)
        return float(np.median(seconds))

    def batch_cost(self) -> tuple[float, float]:
        """(fixed seconds, seconds per padded token) of a batch: a line through the batch times
        ``batch_tokens_within`` measured; (0, 0) before any."""
        return batch_cost_line(self.batch_times)

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
