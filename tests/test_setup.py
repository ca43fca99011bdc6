"""`make setup` installs what this machine can use: CUDA from PyPI where a GPU is, nothing of it elsewhere."""

from __future__ import annotations

import os
import re
import subprocess
import tomllib
from pathlib import Path

import pytest

from tests.conftest import ROOT


def install_line(tmp_path: Path, nvidia_smi: str) -> str:
    """The `pip install -e` line `make setup` would run with this nvidia-smi first on PATH (make -n: nothing runs)."""
    fake = tmp_path / "nvidia-smi"
    fake.write_text(f"#!/bin/sh\n{nvidia_smi}\n")
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}
    dry_run = subprocess.run(["make", "-n", "-B", ".venv/.installed"], cwd=ROOT, env=env, capture_output=True,
                             text=True, check=True)  # fmt: skip
    return next(line for line in dry_run.stdout.splitlines() if "pip install" in line and " -e " in line)


@pytest.mark.parametrize(
    ("nvidia_smi", "extras"),
    [
        ('echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)"', "train,codegen,cuda"),
        ('echo "NVIDIA-SMI has failed: no driver" >&2; exit 9', "train,codegen"),
    ],
    ids=["a GPU", "no driver"],
)
def test_make_setup_installs_cuda_only_where_nvidia_smi_lists_a_gpu(
    tmp_path: Path, nvidia_smi: str, extras: str
) -> None:
    assert f"-e '.[{extras}]'" in install_line(tmp_path, nvidia_smi)


def test_the_cuda_extra_is_the_served_onnxruntime_with_its_cuda_and_cudnn_libraries() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    served = next(d for d in project["dependencies"] if d.startswith("onnxruntime-gpu=="))
    [cuda] = project["optional-dependencies"]["cuda"]
    assert re.sub(r"\[cuda,cudnn\]", "", cuda) == served  # the same version and markers
