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
    """The install line `make setup` would run with this nvidia-smi first on PATH (make -n: nothing runs)."""
    fake = tmp_path / "nvidia-smi"
    fake.write_text(f"#!/bin/sh\n{nvidia_smi}\n")
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}
    dry_run = subprocess.run(["make", "-n", "-B", ".venv/.installed"], cwd=ROOT, env=env, capture_output=True,
                             text=True, check=True)  # fmt: skip
    return next(line for line in dry_run.stdout.splitlines() if "scripts/install.sh" in line and " -e " in line)


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


def fake_venv(tmp_path: Path, pip_config: dict[str, str], uv_exit: int = 0, uv_version: str = "0.0.0") -> Path:
    """A virtualenv whose python answers `pip config list` with pip_config as pip prints it and logs every other
    call, and whose uv says it is uv_version or logs its arguments and exits with uv_exit."""
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    log = tmp_path / "calls"
    listing = tmp_path / "pip-config-list"
    listing.write_text("".join(f"global.{key}={value!r}\n" for key, value in pip_config.items()))
    config = f'[ "$*" = "-m pip config list" ] && cat {listing} && exit 0\n'
    (bin_dir / "python").write_text(f'#!/bin/bash\n{config}echo "python $*" >> {log}\n')
    version = f'[ "$1" = --version ] && echo "uv {uv_version}" && exit 0\n'
    (bin_dir / "uv").write_text(f'#!/bin/bash\n{version}echo "uv $*" >> {log}\nexit {uv_exit}\n')
    for program in bin_dir.iterdir():
        program.chmod(0o755)
    return bin_dir / "python"


def run_install(python: Path, env: dict[str, str]) -> list[str]:
    pip_env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    subprocess.run(["bash", str(ROOT / "scripts/install.sh"), str(python), "-e", ".[train]"],
                   env={**pip_env, **env}, check=True, capture_output=True)  # fmt: skip
    return (python.parents[2] / "calls").read_text().splitlines()


def test_install_hands_pips_indexes_and_find_links_to_uv(tmp_path: Path) -> None:
    config = {"extra-index-url": "file:///a/simple file:///b/simple", "find-links": "/ignored", "constraint": "/c.txt"}
    python = fake_venv(tmp_path, config)
    calls = run_install(python, {"PIP_FIND_LINKS": "/opt/wheels"})  # the variable wins over the file, as in pip
    uv = next(call for call in calls if call.startswith("uv "))
    assert "--extra-index-url file:///a/simple --extra-index-url file:///b/simple" in uv
    assert "--find-links /opt/wheels" in uv and "/ignored" not in uv
    assert "--constraints /c.txt" in uv  # pip's cap on versions holds for uv too
    assert "--index-strategy unsafe-best-match" in uv and uv.endswith("-e .[train]")
    assert not any("pip install -q --no-compile" in call for call in calls)  # uv did it: no pip install after


def test_install_falls_back_to_pip_when_uv_fails(tmp_path: Path) -> None:
    calls = run_install(fake_venv(tmp_path, {}, uv_exit=1), {})
    assert calls[-1].endswith("-m pip install -q --no-compile -e .[train]")


def test_install_keeps_uv_when_the_virtualenv_has_its_version(tmp_path: Path) -> None:
    [version] = re.findall(r"^UV_VERSION=(\S+)$", (ROOT / "scripts/install.sh").read_text(), re.M)
    calls = run_install(fake_venv(tmp_path, {}, uv_version=version), {})
    assert not any("pip install -q uv==" in call for call in calls) and calls[-1].startswith("uv pip install")
    fresh = run_install(fake_venv(tmp_path / "fresh", {}), {})  # an older uv, or none: pip installs the pinned one
    assert f"python -m pip install -q uv=={version}" in fresh
