"""The GPU half of `make gpu-check` (scripts/gpu-check.sh runs it on a machine with an NVIDIA GPU).

    python -m bench.gpu_check [--model-dir artifacts] [--out docs]

Exit codes: 0 all bars met; 1 a parity bar missed; 3 the CUDA execution provider did not load.
Writes docs/gpu/benchmarks.md (``python -m bench --provider cuda``) and docs/gpu/gpu-check.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnxruntime as ort

from bench import compute_bound
from bench.measure import ROOT, load_sweep
from loadtest.run import local_server
from loadtest.texts import load_pool
from server.runtime import CUDA, OnnxRuntime, RuntimeOptions, pad_rows
from server.tokenize import TextTokenizer

FP32_MAX_ABS = 1e-4
FP16_MIN_COSINE = 0.999
WORKERS = (1, 2, 4, 8)


def cuda_loads(model_dir: Path) -> str | None:
    """None when a CUDA session really runs here, else why not."""
    if hasattr(ort, "preload_dlls"):  # CUDA/cuDNN from the nvidia-* wheels the pip extras installed
        ort.preload_dlls()
    if CUDA not in ort.get_available_providers():
        return f"this onnxruntime offers {ort.get_available_providers()}"
    try:
        OnnxRuntime(model_dir, RuntimeOptions(provider="cuda"), pad_id=0)
    except RuntimeError as e:
        return str(e)
    return None


def parity(model_dir: Path, texts: list[str]) -> dict[str, float | bool]:
    tokenizer = TextTokenizer(model_dir / "tokenizer.json")
    ids, mask = pad_rows(tokenizer.encode(texts, truncate=True).rows, 0)
    cpu = OnnxRuntime(model_dir, RuntimeOptions(provider="cpu"), pad_id=0).run(ids, mask)
    cuda = OnnxRuntime(model_dir, RuntimeOptions(provider="cuda"), pad_id=0).run(ids, mask)
    fp16 = OnnxRuntime(model_dir, RuntimeOptions(provider="cuda", precision="fp16"), pad_id=0).run(ids, mask)
    cosines = (fp16 * cpu).sum(1) / (np.linalg.norm(fp16, axis=1) * np.linalg.norm(cpu, axis=1))
    max_abs = float(np.abs(cuda - cpu).max())
    return {
        "fp32_cuda_vs_cpu_max_abs": max_abs,
        "fp16_mean_cosine": float(cosines.mean()),
        "fp16_worst_cosine": float(cosines.min()),
        "passes": max_abs <= FP32_MAX_ABS and float(cosines.min()) >= FP16_MIN_COSINE,
    }


def workers_scaling(model_dir: Path, texts_file: Path, duration: float) -> list[dict[str, object]]:
    rows = []
    for n in WORKERS:
        flags = ["--provider", "cpu", "--workers", str(n)]
        with local_server(str(model_dir), flags) as server:
            single = load_sweep(server.target, (128,), texts_file, duration)[0]
            batch8 = load_sweep(server.target, (32,), texts_file, duration, 8)[0]
        rows.append({"workers": n, "single_128": single["texts_per_second"], "batch8_32": batch8["texts_per_second"]})
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=Path("artifacts"))
    parser.add_argument("--out", type=Path, default=Path("docs"))
    parser.add_argument("--duration", type=float, default=8.0)
    args = parser.parse_args(argv)
    why_not = cuda_loads(args.model_dir)
    if why_not:
        print(f"gpu-check: the CUDA execution provider did not load: {why_not}", file=sys.stderr)
        raise SystemExit(3)
    texts = load_pool().mixed(random.Random(0), 64)
    minilm_dir = args.model_dir / "bench-minilm-size"
    compute_bound.build(args.model_dir, minilm_dir)
    report: dict[str, object] = {
        "gpu": subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.strip(),
        "cpu_cores": os.cpu_count(),
        "parity": {"trained": parity(args.model_dir, texts), "minilm_size": parity(minilm_dir, texts)},
    }
    out = args.out / "gpu"
    out.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [sys.executable, "-m", "bench", "--model-dir", str(args.model_dir), "--provider", "cuda", "--out", str(out)],
        cwd=ROOT,
        check=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        texts_file = Path(tmp) / "texts.json"
        texts_file.write_text(json.dumps(load_pool().mixed(random.Random(0), 3000)))
        report["workers"] = workers_scaling(args.model_dir, texts_file, args.duration)
    (out / "gpu-check.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        "# GPU check",
        "",
        f"Produced by `make gpu-check` on {report['gpu']} with {report['cpu_cores']} CPU cores. "
        "Speed figures on the CUDA execution provider: `benchmarks.md` in this folder.",
        "",
        "| model | fp32 CUDA vs CPU max abs | fp16 mean cosine | fp16 worst cosine | passes |",
        "|---|---:|---:|---:|---|",
    ]
    for name, p in report["parity"].items():  # type: ignore[attr-defined]
        lines.append(
            f"| {name} | {p['fp32_cuda_vs_cpu_max_abs']:.2e} | {p['fp16_mean_cosine']:.5f} | "
            f"{p['fp16_worst_cosine']:.5f} | {p['passes']} |"
        )
    lines += ["", "`--workers` on the CPU at saturation (texts/s):", "", "| workers | 128 x 1 text | 32 x 8 texts |"]
    lines += ["|---:|---:|---:|"]
    lines += [f"| {w['workers']} | {w['single_128']:.0f} | {w['batch8_32']:.0f} |" for w in report["workers"]]  # type: ignore[attr-defined]
    (out / "gpu-check.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if not all(p["passes"] for p in report["parity"].values()):  # type: ignore[attr-defined]
        raise SystemExit(1)


if __name__ == "__main__":
    main()
