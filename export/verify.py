"""Parity report: eager PyTorch vs TorchScript vs ONNX Runtime on fresh random padded batches. ONNX Runtime runs
``model.onnx`` and, where the export wrote it, ``model.cpu.onnx`` (the graph the server's CPU sessions run).

Bars (every row, every pair of the backends): max absolute difference <= 1e-5 and cosine
similarity >= 0.99999. Also: a row computed alone equals the same row inside a padded batch
(eager and both ONNX Runtime graphs), and no output is NaN or infinite.

    python -m export.verify [--model-dir artifacts]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
from tqdm import tqdm

from contract.manifest import CPU_DISABLED_OPTIMIZERS, CPU_MODEL_FILE

MAX_ABS_BAR = 1e-5
COSINE_BAR = 0.99999
BATCH_SIZES = (1, 3, 16, 64)
SEQUENCE_LENGTHS = (1, 2, 17, 128)  # plus the model's max length
# The random batches' seed. The int8 builds are compared with fp32 on the same batches, and the kept build
# can depend on them (two builds' mean cosines differ in the fifth digit: docs/decisions/0012).
BATCH_SEED = 99
CPU_GRAPH = "onnx cpu graph"  # the parity report's name for model.cpu.onnx, opened as the server opens it
ROWS_ALONE_PER_CASE = 8  # rows re-run one by one per case; all of them for batches up to this size

Backend = Callable[[np.ndarray, np.ndarray], np.ndarray]


def progress(cases: Sequence[tuple[int, int]], what: str) -> Iterator[tuple[int, int]]:
    """The (batch, sequence) cases of a check with a progress bar: all-MiniLM-L6-v2's take a minute on 2 cores.
    The bar counts padded tokens, which a case's time follows: counted in cases, it would show three quarters
    done after a quarter of the time."""
    with tqdm(total=sum(b * s for b, s in cases), desc=what, unit="token", unit_scale=True, mininterval=1.0,
              leave=False) as bar:  # fmt: skip
        for batch, sequence in cases:
            yield batch, sequence
            bar.update(batch * sequence)


def cases(max_len: int, batch_sizes: Sequence[int] = BATCH_SIZES) -> list[tuple[int, int]]:
    """Every (batch, sequence) shape checked: each batch size at each length, the model's max length included."""
    lengths = sorted({min(s, max_len) for s in (*SEQUENCE_LENGTHS, max_len)})
    return [(batch, sequence) for batch in batch_sizes for sequence in lengths]


@dataclass
class PairFigures:
    max_abs: float = 0.0
    min_cosine: float = 1.0

    def update(self, a: np.ndarray, b: np.ndarray) -> None:
        self.max_abs = max(self.max_abs, float(np.abs(a - b).max()))
        self.min_cosine = min(self.min_cosine, float(row_cosines(a, b).min()))

    def passes(self) -> bool:
        return self.max_abs <= MAX_ABS_BAR and self.min_cosine >= COSINE_BAR


@dataclass(frozen=True)
class ReferenceBatch:
    """One parity case's inputs and fp32 ONNX Runtime's embeddings of them: the int8 and fp16 builds are
    compared with these, so fp32 runs each batch once."""

    ids: np.ndarray  # (B, S) int64
    mask: np.ndarray  # (B, S) int64
    embeddings: np.ndarray  # (B, D) float32


@dataclass
class ParityReport:
    cases: list[dict[str, object]] = field(default_factory=list)
    pairs: dict[str, PairFigures] = field(default_factory=dict)
    row_alone_max_abs: dict[str, float] = field(default_factory=dict)
    non_finite: int = 0
    # The "onnx" backend's outputs on every case, for the precision comparison; not in the manifest.
    reference_batches: list[ReferenceBatch] = field(default_factory=list, repr=False)

    def passes(self) -> bool:
        return (
            all(p.passes() for p in self.pairs.values())
            and all(v <= MAX_ABS_BAR for v in self.row_alone_max_abs.values())
            and self.non_finite == 0
        )

    def to_dict(self) -> dict[str, object]:
        return {
            "bars": {"max_abs": MAX_ABS_BAR, "min_cosine": COSINE_BAR},
            "passed": self.passes(),
            "pairs": {k: asdict(v) for k, v in self.pairs.items()},
            "row_alone_max_abs": self.row_alone_max_abs,
            "non_finite_outputs": self.non_finite,
            "cases": self.cases,
        }

    def table(self) -> str:
        lines = ["| batch | seq | pair | max abs diff | min cosine |", "|---:|---:|---|---:|---:|"]
        for c in self.cases:
            lines.append(
                f"| {c['batch']} | {c['sequence']} | {c['pair']} | {c['max_abs']:.2e} | {c['min_cosine']:.7f} |"
            )
        lines.append("")
        lines.append("| pair (worst over all cases) | max abs diff | min cosine | pass |")
        lines.append("|---|---:|---:|---|")
        for name, p in self.pairs.items():
            lines.append(f"| {name} | {p.max_abs:.2e} | {p.min_cosine:.7f} | {'yes' if p.passes() else 'NO'} |")
        for name, v in self.row_alone_max_abs.items():
            lines.append(f"| row alone vs in batch ({name}) | {v:.2e} | | {'yes' if v <= MAX_ABS_BAR else 'NO'} |")
        lines.append(f"\nnon-finite outputs: {self.non_finite}; overall: {'PASS' if self.passes() else 'FAIL'}")
        return "\n".join(lines)


def row_cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    num = (a * b).sum(axis=1)
    den = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    return num / np.maximum(den, 1e-12)


def random_batch(
    rng: np.random.Generator, batch: int, sequence: int, vocab_size: int, pad_id: int
) -> tuple[np.ndarray, np.ndarray]:
    """Each row gets its own random length in [1, sequence], the first row the full length, padding after."""
    lengths = rng.integers(1, sequence + 1, size=batch)
    lengths[0] = sequence
    ids = rng.integers(0, vocab_size - 1, size=(batch, sequence), dtype=np.int64)
    ids = np.where(ids >= pad_id, ids + 1, ids)  # never the pad id in a real position
    mask = (np.arange(sequence)[None, :] < lengths[:, None]).astype(np.int64)
    return np.where(mask == 1, ids, pad_id).astype(np.int64), mask


def torch_backend(module: torch.nn.Module | torch.jit.ScriptModule) -> Backend:
    def run(ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return module(torch.from_numpy(ids), torch.from_numpy(mask)).numpy()

    return run


def cpu_session(path: Path | str, disabled_optimizers: Sequence[str] = ()) -> ort.InferenceSession:
    """An ONNX Runtime CPU session whose threads sleep between runs, as the server's do by default. The export
    runs several sessions in turn on the same cores (the checks, the int8 builds' timing): threads busy-waiting
    after one session's run take the cores of the next, and would time each int8 build with its neighbours'
    spinning (docs/decisions/0012). Denormals are flushed to zero, as the server's sessions flush them
    (docs/decisions/0003), so the builds are checked and timed under the arithmetic they are served with.
    ``disabled_optimizers``: ONNX Runtime fusions to go without, as the server's CPU sessions go without
    CPU_DISABLED_OPTIMIZERS (docs/decisions/0027)."""
    options = ort.SessionOptions()  # graph optimisations: all, ONNX Runtime's default
    options.log_severity_level = 3
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.add_session_config_entry("session.inter_op.allow_spinning", "0")
    options.add_session_config_entry("session.set_denormal_as_zero", "1")
    return ort.InferenceSession(
        str(path), options, providers=["CPUExecutionProvider"], disabled_optimizers=list(disabled_optimizers)
    )


def onnx_backend(path: Path | str, disabled_optimizers: Sequence[str] = ()) -> Backend:
    session = cpu_session(path, disabled_optimizers)

    def run(ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        return session.run(["embeddings"], {"input_ids": ids, "attention_mask": mask})[0]

    return run


def verify(
    backends: dict[str, Backend],
    vocab_size: int,
    pad_id: int,
    max_len: int,
    seed: int = BATCH_SEED,
    batch_sizes: Sequence[int] = BATCH_SIZES,
) -> ParityReport:
    """Every pair of backends on every case; the "onnx" backend's outputs are kept in the report."""
    rng = np.random.default_rng(seed)
    rows_rng = np.random.default_rng([seed, 1])  # the rows re-run alone: the batches do not depend on them
    report = ParityReport()
    names = list(backends)
    pair_names = [(a, b) for i, a in enumerate(names) for b in names[i + 1 :]]
    for a, b in pair_names:
        report.pairs[f"{a} vs {b}"] = PairFigures()
    for batch, sequence in progress(cases(max_len, batch_sizes), "parity"):
        ids, mask = random_batch(rng, batch, sequence, vocab_size, pad_id)
        outputs = {name: fn(ids, mask) for name, fn in backends.items()}
        if "onnx" in outputs:
            report.reference_batches.append(ReferenceBatch(ids, mask, outputs["onnx"]))
        report.non_finite += sum(int((~np.isfinite(o)).sum()) for o in outputs.values())
        for a, b in pair_names:
            case = PairFigures()
            case.update(outputs[a], outputs[b])
            report.pairs[f"{a} vs {b}"].update(outputs[a], outputs[b])
            report.cases.append({"batch": batch, "sequence": sequence, "pair": f"{a} vs {b}", **asdict(case)})
        for name in ("eager", "onnx", CPU_GRAPH):
            if name in backends:
                worst = row_alone_max_abs(backends[name], ids, mask, outputs[name], rows_rng)
                report.row_alone_max_abs[name] = max(report.row_alone_max_abs.get(name, 0.0), worst)
    # A batch where one row has a single real token beside a full-length row: no NaN from masking.
    ids, mask = random_batch(rng, 2, max_len, vocab_size, pad_id)
    mask[1, 1:] = 0
    ids[1, 1:] = pad_id
    for fn in backends.values():
        report.non_finite += int((~np.isfinite(fn(ids, mask))).sum())
    return report


def row_alone_max_abs(
    fn: Backend, ids: np.ndarray, mask: np.ndarray, batched: np.ndarray, rng: np.random.Generator
) -> float:
    rows = np.arange(len(ids))
    if len(rows) > ROWS_ALONE_PER_CASE:
        rows = rng.choice(rows, size=ROWS_ALONE_PER_CASE, replace=False)
    worst = 0.0
    for r in rows:
        length = int(mask[r].sum())
        alone = fn(ids[r : r + 1, :length], mask[r : r + 1, :length])
        worst = max(worst, float(np.abs(alone[0] - batched[r]).max()))
    return worst


def verify_artifacts(model_dir: Path | str) -> ParityReport:
    from export.torchscript import load_torchscript
    from model.checkpoint import load_checkpoint

    model_dir = Path(model_dir)
    model, _ = load_checkpoint(model_dir / "checkpoint.pt")
    backends = {
        "eager": torch_backend(model),
        "torchscript": torch_backend(load_torchscript(model_dir / "model.torchscript.pt")),
        "onnx": onnx_backend(model_dir / "model.onnx"),
    }
    if (model_dir / CPU_MODEL_FILE).is_file():  # the graph the server's CPU sessions run, opened as they open it
        backends[CPU_GRAPH] = onnx_backend(model_dir / CPU_MODEL_FILE, CPU_DISABLED_OPTIMIZERS)
    config = model.config
    return verify(backends, config.vocab_size, config.pad_id, config.max_len)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", default="artifacts")
    args = parser.parse_args(argv)
    report = verify_artifacts(args.model_dir)
    print(report.table())
    print(json.dumps({"passed": report.passes()}))
    if not report.passes():
        raise SystemExit("parity check failed")


if __name__ == "__main__":
    main()


INT8_MEAN_COSINE_BAR = 0.99


def row_cosines_against_fp32(
    reference: Sequence[ReferenceBatch], other_paths: Sequence[Path | str]
) -> list[np.ndarray]:
    """Each row's cosine between fp32 (the parity's ONNX Runtime outputs) and each other build on the same
    random padded batches, CPU."""
    others = [onnx_backend(path) for path in other_paths]
    cosines: list[list[np.ndarray]] = [[] for _ in others]
    shapes = [batch.ids.shape for batch in reference]
    for _, batch in zip(progress(shapes, f"{len(others)} builds against fp32"), reference, strict=True):
        for rows, other in zip(cosines, others, strict=True):
            rows.append(row_cosines(batch.embeddings, other(batch.ids, batch.mask)))
    return [np.concatenate(rows) for rows in cosines]


def precision_report(rows_by_build: dict[str, np.ndarray]) -> dict:  # type: ignore[type-arg]
    """Each build's rows' cosines to fp32 ONNX Runtime on the same random padded batches: mean and worst."""
    report: dict[str, dict[str, float | bool | str]] = {}
    for name, all_rows in rows_by_build.items():
        mean = float(all_rows.mean())
        report[f"{name} vs fp32"] = {
            "mean_cosine": mean,
            "worst_row_cosine": float(all_rows.min()),
            "rows": int(all_rows.size),
            "provider": "CPUExecutionProvider",
        }
        if name == "int8":
            report[f"{name} vs fp32"]["passes"] = mean >= INT8_MEAN_COSINE_BAR
    return report
