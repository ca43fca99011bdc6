#!/usr/bin/env bash
# `make gpu-check`: the CUDA backend's parity and speed, on a machine with an NVIDIA GPU.
#
#   1. installs the CUDA 13 / cuDNN 9 libraries ONNX Runtime needs (the project's `cuda` extra: onnxruntime-gpu's
#      cuda and cudnn extras; `make setup` installs it on its own where nvidia-smi lists a GPU);
#   2. export parity on the CUDA execution provider: fp32 (TF32 off) against CPU (max abs <= 1e-4) and fp16
#      (cosine >= 0.999), for the trained model and all-MiniLM-L6-v2;
#   3. `python -m bench --provider cuda` -> docs/gpu/benchmarks.md;
#   4. --workers 1, 2, 4 and 8 sharing the GPU, fp32 and fp16, loaded over 8 connections -> docs/gpu/gpu-check.md.
#
# Without a GPU it stops at once with a clear message and exit code 2: nothing is installed or changed.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu-check: no NVIDIA GPU on this machine (nvidia-smi is missing or lists no device)." >&2
    echo "gpu-check: nothing was run; the GPU figures in docs/benchmarks.md stay pending." >&2
    exit 2
fi
nvidia-smi -L

make dev-setup
bash scripts/install.sh .venv/bin/python -e '.[cuda]'  # a no-op where make setup saw the GPU
make "${ARTIFACTS:-artifacts}/model.onnx" "${ARTIFACTS:-artifacts}/minilm/manifest.json"
.venv/bin/python -m bench.gpu_check --model-dir "${ARTIFACTS:-artifacts}" --out docs
