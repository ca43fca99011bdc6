"""``manifest.json``: the typed contract between the export (which writes it) and everything that reads
an exported model folder (the server, training's teacher, the benchmark).

Torch-free and dependency-free. ``Manifest.read`` is the only way in and ``Manifest.write`` the only way
out; a folder written under another ``schema_version`` is refused with a message saying what to do, and
``check_files`` refuses a file that is not the one the export wrote.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
MANIFEST_FILE = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"
MODEL_FILES = {"fp32": "model.onnx", "int8": "model.int8.onnx", "fp16": "model.fp16.onnx"}  # by precision
# The fp32 graph with ONNX Runtime's fused Attention operator (export/attention_fusion.py): what the server's CPU
# sessions run in place of model.onnx where the folder has it.
CPU_MODEL_FILE = "model.cpu.onnx"
# ONNX Runtime graph fusions the server opens a CPU session without, and the export's parity check the CPU graph: its
# CPU SkipLayerNormalization kernel (a residual Add fused into the LayerNormalization after it) ran both exported
# models slower than the two operators it replaces (docs/decisions/0027-no-skip-layer-norm-fusion-on-the-cpu.md).
CPU_DISABLED_OPTIMIZERS = ("SkipLayerNormFusion",)
# The int8 build a distillation runs as its teacher (model/distill.py): the transformer optimizer's graph with
# per-channel int8 weights (TEACHER_BUILD in export/quantize.py), whichever build the server's timing keeps as
# model.int8.onnx. The student's recipe was measured on this build's targets (docs/decisions/0028).
TEACHER_FILE = "model.teacher.int8.onnx"


def cpu_model_path(model_dir: Path, precision: str) -> Path:
    """The graph a CPU session runs: for fp32, ``model.cpu.onnx`` where the folder has it (each attention
    block as ONNX Runtime's fused Attention kernel, the same outputs: export/attention_fusion.py; why:
    docs/decisions/0026); otherwise the precision's own file, which a GPU session runs too."""
    fused = model_dir / CPU_MODEL_FILE
    if precision == "fp32" and fused.is_file():
        return fused
    return model_dir / MODEL_FILES[precision]


class ManifestError(ValueError):
    """A manifest this code cannot read: another schema version, a missing field, a wrong type."""


@dataclass(frozen=True)
class Manifest:
    model_id: str  # the name a model is served under unless given one (`--model NAME=DIR`)
    model_version: str  # a digest of the config and weights: the same weights, the same version
    config: Mapping[str, Any]  # the encoder's configuration (model/transformer.py EncoderConfig)
    dim: int  # embedding width: the output's second axis
    max_length: int  # tokens per input, special tokens included
    vocab_size: int
    pad_id: int
    source: str = ""  # where the weights came from
    opset: int = 0
    inputs: tuple[str, ...] = ("input_ids", "attention_mask")  # int64 [batch, sequence]
    output: str = "embeddings"  # float32 [batch, dim], mean-pooled
    normalized: bool = False  # whether the output rows are unit length (the server normalises on request)
    matryoshka_dims: tuple[int, ...] = ()  # lengths built and measured to stand alone, full width last; () = (dim,)
    files: Mapping[str, str] = field(default_factory=dict)  # file name -> sha256
    training: Mapping[str, Any] = field(default_factory=dict)  # the training summary
    parity: Mapping[str, Any] = field(default_factory=dict)  # eager / TorchScript / ONNX Runtime figures
    precision: Mapping[str, Any] = field(default_factory=dict)  # int8 and fp16 figures, the int8 build kept
    triton_repository: str = ""  # the Triton model repository's folder, relative to the model folder
    schema_version: int = SCHEMA_VERSION

    @property
    def trained_dimensions(self) -> tuple[int, ...]:
        return self.matryoshka_dims or (self.dim,)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["files"] = {name: {"sha256": digest} for name, digest in self.files.items()}
        data["inputs"], data["matryoshka_dims"] = list(self.inputs), list(self.matryoshka_dims)
        return {"schema_version": data.pop("schema_version"), **data}

    def write(self, folder: Path | str) -> Path:
        path = Path(folder) / MANIFEST_FILE
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = MANIFEST_FILE) -> Manifest:
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            found = "no schema_version" if version is None else f"schema_version {version!r}"
            raise ManifestError(
                f"{where}: {found}; this code reads schema_version {SCHEMA_VERSION}. Export the model again "
                "with this version (make export, or python -m export.pretrained for a pretrained checkpoint)"
            )
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        missing = sorted(f.name for f in fields(cls) if f.name not in data and f.default is MISSING)
        if unknown or missing:
            raise ManifestError(f"{where}: unknown fields {unknown}, missing fields {missing}")
        values = dict(data)
        for name, (shape, read) in _READERS.items():
            if name in data:
                try:
                    values[name] = read(data[name])
                except TypeError as e:  # what every reader raises
                    raise ManifestError(f"{where}: malformed {name}: it must be {shape} ({e})") from None
        manifest = cls(**values)
        manifest._check_types(where)
        return manifest

    @classmethod
    def read(cls, folder: Path | str) -> Manifest:
        """The manifest of an exported model folder. FileNotFoundError if there is none, ManifestError if
        it cannot be read as this schema version."""
        path = Path(folder) / MANIFEST_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: run `make export` or point at an exported model folder")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ManifestError(f"{path}: not JSON ({e})") from None
        if not isinstance(data, dict):
            raise ManifestError(f"{path}: not a JSON object")
        return cls.from_dict(data, str(path))

    def check_files(self, folder: Path | str, names: Iterable[str]) -> None:
        """ManifestError naming each of ``names`` whose bytes differ from the sha256 the export recorded: a copy
        cut short, an export stopped half-way, a file from another build beside this manifest. A name the
        manifest does not list is not checked."""
        folder = Path(folder)
        differ = []
        for name in names:
            if name in self.files and (folder / name).is_file() and file_sha256(folder / name) != self.files[name]:
                differ.append(name)
        if differ:
            raise ManifestError(
                f"{folder}: {', '.join(differ)} not the file{'s' if len(differ) > 1 else ''} this manifest.json was "
                "exported with (its sha256 differs): export the model again, or copy the whole folder"
            )

    def _check_types(self, where: str) -> None:
        expected = {"model_id": str, "model_version": str, "dim": int, "max_length": int, "vocab_size": int,
                    "pad_id": int, "source": str, "opset": int, "output": str, "normalized": bool,
                    "triton_repository": str}  # fmt: skip
        wrong = [
            f"{name} should be {kind.__name__}"
            for name, kind in expected.items()
            if not (_is_integer(getattr(self, name)) if kind is int else isinstance(getattr(self, name), kind))
        ]
        wrong += [f"{name} should be an object" for name in ("config", "training", "parity", "precision")
                  if not isinstance(getattr(self, name), Mapping)]  # fmt: skip
        if wrong:
            raise ManifestError(f"{where}: {'; '.join(wrong)}")
        if self.dim < 1 or self.max_length < 1 or self.vocab_size < 1:
            wrong.append("dim, max_length and vocab_size must be positive")
        if self.matryoshka_dims and (self.matryoshka_dims[-1] != self.dim or min(self.matryoshka_dims) < 1):
            wrong.append("matryoshka_dims must end with dim")
        if wrong:
            raise ManifestError(f"{where}: {'; '.join(wrong)}")


def _is_integer(value: object) -> bool:
    """A JSON integer: Python's bool is an int, JSON's true is not."""
    return isinstance(value, int) and not isinstance(value, bool)


def _of_kind(value: object, kind: type) -> Any:
    """value where it is a kind (a string where a list belongs would iterate as its characters); else TypeError."""
    if not isinstance(value, kind):
        raise TypeError(f"found {type(value).__name__}")
    return value


def _read_files(files: object) -> dict[str, str]:
    digests = {}
    for name, entry in _of_kind(files, Mapping).items():
        if not isinstance(entry, Mapping) or not isinstance(entry.get("sha256"), str):
            raise TypeError(f"{name!r} is {json.dumps(entry)}")
        digests[str(name)] = entry["sha256"]
    return digests


def _read_names(names: object) -> tuple[str, ...]:
    return tuple(str(name) for name in _of_kind(names, list))


def _read_integers(values: object) -> tuple[int, ...]:
    integers = _of_kind(values, list)
    if not all(map(_is_integer, integers)):
        raise TypeError(f"found {json.dumps(integers)}")  # int() would take 32.7, "32" and true
    return tuple(integers)


# The fields whose JSON is not their value: the shape each must have, and its reader.
_READERS: dict[str, tuple[str, Callable[[object], object]]] = {
    "files": ('an object of file names to {"sha256": "<hex>"}', _read_files),
    "inputs": ("a list of input names", _read_names),
    "matryoshka_dims": ("a list of integers", _read_integers),
}


def file_sha256(path: Path) -> str:
    """The hex sha256 of a file's bytes, as ``files`` records it."""
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()
