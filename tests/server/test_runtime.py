"""The ONNX Runtime backend: the floating-point mode of the threads that call it."""

from __future__ import annotations

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
