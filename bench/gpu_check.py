"""The GPU half of `make gpu-check` (scripts/gpu-check.sh runs it on a machine with an NVIDIA GPU).

    python -m bench.gpu_check [--model-dir artifacts] [--out docs]

Exit codes: 0 all bars met; 1 a parity bar missed; 3 the CUDA execution provider did not load.
Writes docs/gpu/benchmarks.md (``python -m bench --provider cuda``) and docs/gpu/gpu-check.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from bench.measure import ROOT, cpu_name, gpu_name, merge_counts, nvidia_smi, texts_on_disk, traffic, workers_reading
from bench.report import table
from server.backend.ort import CUDA, OnnxRuntime, RuntimeOptions, pad_rows
from server.core.tokenizer import TextTokenizer

FP32_MAX_ABS = 1e-4
FP16_MIN_COSINE = 0.999
WORKERS = (1, 2, 4, 8)
LOAD_PROCESSES = 8
PARITY_TEXTS = 64
GPU_MEMORY_READ = "after both loads, the server still running"  # when workers_reading asks nvidia-smi
SCALING_LOADS = ("1 text x 128 clients", "8 texts x 32 clients")  # each --workers reading's two loads, in order
SCALING_FIGURES = (("texts_per_second", 0), ("p50_ms", 2), ("p99_ms", 2))  # per load, with decimals


def parity(model_dir: Path, texts: list[str]) -> dict[str, Any]:
    tokenizer = TextTokenizer(model_dir / "tokenizer.json")
    ids, mask = pad_rows(tokenizer.encode(texts, truncate=True).rows, 0)
    cpu = OnnxRuntime(model_dir, RuntimeOptions(provider="cpu"), pad_id=0).run(ids, mask)
    cuda_runtime = OnnxRuntime(model_dir, RuntimeOptions(provider="cuda"), pad_id=0)
    cuda = cuda_runtime.run(ids, mask)
    fp16 = OnnxRuntime(model_dir, RuntimeOptions(provider="cuda", precision="fp16"), pad_id=0).run(ids, mask)
    cosines = (fp16 * cpu).sum(1) / (np.linalg.norm(fp16, axis=1) * np.linalg.norm(cpu, axis=1))
    max_abs = float(np.abs(cuda - cpu).max())
    options = cuda_runtime.session.get_provider_options().get(CUDA, {})
    return {"providers": cuda_runtime.providers, "cuda_options": options, "fp32_cuda_vs_cpu_max_abs": max_abs,
            "fp16_mean_cosine": float(cosines.mean()), "fp16_worst_cosine": float(cosines.min()),
            "passes": max_abs <= FP32_MAX_ABS and float(cosines.min()) >= FP16_MIN_COSINE}  # fmt: skip


def scaling(model_dir: Path, texts_file: Path, duration: float) -> list[dict[str, object]]:
    """`--workers` processes sharing one GPU, loaded by LOAD_PROCESSES load generators (one connection each); the GPU
    memory in use (MiB, -1 where nvidia-smi does not tell) read after the loads."""
    rows: list[dict[str, object]] = []

    def gpu_memory() -> dict[str, int]:
        return {"gpu_memory_mib": int((nvidia_smi("memory.used") or ["-1"])[0])}

    configs = [(model_dir, "fp32", n) for n in WORKERS] + [(model_dir, "fp16", max(WORKERS))]
    configs += [(model_dir / "minilm", precision, max(WORKERS)) for precision in ("fp32", "fp16")]
    for folder, precision, n in configs:
        name = "trained" if folder == model_dir else "all-MiniLM-L6-v2"
        print(f"{name} {precision} --provider cuda --workers {n}", flush=True)
        flags = ["--provider", "cuda", "--precision", precision]
        reading = workers_reading(folder, flags, n, LOAD_PROCESSES, texts_file, duration, gpu_memory)
        rows.append({"model": name, "precision": precision, "workers": n, **reading})
    return rows


def scaling_table(rows: list[dict[str, Any]]) -> str:
    """The `--workers` readings: one row per model, precision and workers."""
    cells = [cell for load in SCALING_LOADS for cell in (f"{load}: texts/s", "p50 ms", "p99 ms")]
    header = ["model", "precision", "workers", "GPU memory MiB", *cells, "errors"]
    table_rows = []
    for r in rows:
        figures = [f"{x[k]:.{d}f}" for x in (r["single"], r["batch8"]) for k, d in SCALING_FIGURES]
        kinds = merge_counts(x.get("error_kinds", {}) for x in (r["single"], r["batch8"]))
        errors = ", ".join(f"{count} {kind}" for kind, count in sorted(kinds.items())) or "none"
        table_rows.append([r["model"], r["precision"], r["workers"], r["gpu_memory_mib"], *figures, errors])
    return table(header, table_rows, 2)


def measured_by(run: dict[str, Any]) -> str:
    return (
        f"Measured by `{run['command']}` on {run['date']}: {run['gpu']}, {run['cpu']} ({run['cpu_cores']} cores), "
        f"onnxruntime-gpu {run['onnxruntime']}."
    )


def write_markdown(report: dict[str, Any], path: Path) -> None:
    """gpu-check.md from bench/gpu-check.md.tmpl. Each step carries the run that measured it (steps may run
    apart); a step never run says so in its table's place."""
    parity, scaling = report.get("parity"), report.get("scaling")
    parity_header = ["model", "providers loaded", "fp32 CUDA vs CPU max abs", "fp16 mean cosine", "fp16 worst cosine"]
    parity_rows = [
        [name, ", ".join(p["providers"]), f"{p['fp32_cuda_vs_cpu_max_abs']:.2e}", f"{p['fp16_mean_cosine']:.6f}",
         f"{p['fp16_worst_cosine']:.6f}", p["passes"]]
        for name, p in (parity or {}).get("models", {}).items()
    ]  # fmt: skip
    template = (Path(__file__).parent / "gpu-check.md.tmpl").read_text()
    path.write_text(template.format(
        parity_texts=PARITY_TEXTS, fp32_max_abs=FP32_MAX_ABS, fp16_min_cosine=FP16_MIN_COSINE,
        load_processes=LOAD_PROCESSES, duration=scaling["run"]["duration"] if scaling else 0,
        gpu_memory_read=scaling["run"]["gpu_memory_read"] if scaling else GPU_MEMORY_READ,
        parity_run=measured_by(parity["run"]) if parity else "Not run: `--steps` left out `parity`.",
        parity_table=table([*parity_header, "passes"], parity_rows, 2) if parity else "",
        scaling_run=measured_by(scaling["run"]) if scaling else "Not run: `--steps` left out `scaling`.",
        scaling_table=scaling_table(scaling["rows"]) if scaling else "",
    ))  # fmt: skip


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=Path("artifacts"))
    parser.add_argument("--out", type=Path, default=Path("docs"))
    parser.add_argument("--duration", type=float, default=8.0)
    parser.add_argument("--steps", default="parity,bench,scaling", help="of parity, bench (python -m bench), scaling")
    args = parser.parse_args(argv)
    steps = set(args.steps.split(","))
    try:  # the server's own check: refused where CUDA is not offered, or offered and did not load
        OnnxRuntime(args.model_dir, RuntimeOptions(provider="cuda"), pad_id=0)
    except RuntimeError as e:
        print(f"gpu-check: the CUDA execution provider did not load: {e}", file=sys.stderr)
        raise SystemExit(3) from None
    out = args.out / "gpu"
    out.mkdir(parents=True, exist_ok=True)
    report_file = out / "gpu-check.json"
    # A step run now replaces that step's results and its run alone: steps run apart keep their own dates.
    report: dict[str, Any] = json.loads(report_file.read_text()) if report_file.is_file() else {}
    command = shlex.join(["python", "-m", "bench.gpu_check", *(sys.argv[1:] if argv is None else argv)])
    run = {"date": datetime.date.today().isoformat(), "command": command, "gpu": gpu_name(), "cpu": cpu_name(),
           "cpu_cores": os.cpu_count(), "onnxruntime": ort.__version__, "duration": args.duration}  # fmt: skip
    if "parity" in steps:
        texts = traffic(PARITY_TEXTS)
        models = {"trained": args.model_dir, "all-MiniLM-L6-v2": args.model_dir / "minilm"}
        report["parity"] = {"run": run, "models": {name: parity(folder, texts) for name, folder in models.items()}}
        report_file.write_text(json.dumps(report, indent=2) + "\n")
    if "bench" in steps:
        bench = [sys.executable, "-m", "bench", "--model-dir", str(args.model_dir), "--provider", "cuda"]
        subprocess.run([*bench, "--out", str(out), "--duration", str(args.duration)], cwd=ROOT, check=True)
    if "scaling" in steps:
        with texts_on_disk(traffic()) as texts_file:
            report["scaling"] = {
                "run": run | {"gpu_memory_read": GPU_MEMORY_READ},
                "rows": scaling(args.model_dir, texts_file, args.duration),
            }
        report_file.write_text(json.dumps(report, indent=2) + "\n")
    write_markdown(report, out / "gpu-check.md")
    print((out / "gpu-check.md").read_text())
    if not all(p["passes"] for p in report.get("parity", {}).get("models", {}).values()):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
