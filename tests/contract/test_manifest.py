"""manifest.json: the one typed reader and writer, and refusals that say what to do."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from contract.manifest import SCHEMA_VERSION, Manifest, ManifestError
from tests.conftest import serve_exits


def small() -> Manifest:
    return Manifest(
        model_id="m", model_version="v1", config={"d_model": 8}, dim=8, max_length=16, vocab_size=100, pad_id=0,
        matryoshka_dims=(4, 8), files={"model.onnx": "ab" * 32},
    )  # fmt: skip


def test_a_written_manifest_reads_back_equal(tmp_path: Path) -> None:
    path = small().write(tmp_path)
    data = json.loads(path.read_text())
    assert data["schema_version"] == SCHEMA_VERSION and data["files"] == {"model.onnx": {"sha256": "ab" * 32}}
    assert Manifest.read(tmp_path) == small()
    assert Manifest.read(tmp_path).trained_dimensions == (4, 8)


def test_the_exported_models_manifest_is_read_by_the_typed_reader(tiny_artifacts: Path) -> None:
    manifest = Manifest.read(tiny_artifacts)
    assert manifest.schema_version == SCHEMA_VERSION and manifest.dim == manifest.config["d_model"]
    assert {"model.onnx", "tokenizer.json"} <= set(manifest.files)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"schema_version": 2}, "schema_version 2; this code reads schema_version 1. Export the model again"),
        ({"schema_version": None}, "no schema_version"),
        ({"dimm": 8}, "unknown fields ['dimm']"),
        ({"dim": "8"}, "dim should be int"),
        ({"matryoshka_dims": [4, 6]}, "matryoshka_dims must end with dim"),
        ({"files": {"model.onnx": "ab"}}, 'malformed files: it must be an object of file names to {"sha256"'),
        ({"files": ["model.onnx"]}, "malformed files: it must be an object"),
        ({"inputs": "input_ids"}, "malformed inputs: it must be a list of input names (found str)"),
        ({"matryoshka_dims": [32, "x"]}, "malformed matryoshka_dims: it must be a list of integers"),
        ({"matryoshka_dims": [32.5, 8]}, "malformed matryoshka_dims: it must be a list of integers (found [32.5, 8])"),
    ],
)
def test_a_manifest_of_another_schema_or_shape_is_refused_naming_the_problem(
    tmp_path: Path, change: dict[str, object], message: str
) -> None:
    data = {**small().to_dict(), **change}
    if change.get("schema_version", 1) is None:
        del data["schema_version"]
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ManifestError, match=re.escape(message)):
        Manifest.read(tmp_path)


def test_a_missing_field_is_named(tmp_path: Path) -> None:
    data = small().to_dict()
    del data["pad_id"]
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ManifestError, match=r"missing fields \['pad_id'\]"):
        Manifest.read(tmp_path)


def copy_model(source: Path, folder: Path) -> None:
    for name in ("model.onnx", "tokenizer.json", "manifest.json"):
        (folder / name).write_bytes((source / name).read_bytes())


def test_the_server_refuses_a_model_of_another_schema_version_with_exit_2(tiny_artifacts: Path, tmp_path: Path) -> None:
    copy_model(tiny_artifacts, tmp_path)
    data = json.loads((tiny_artifacts / "manifest.json").read_text())
    (tmp_path / "manifest.json").write_text(json.dumps({**data, "schema_version": 99}))
    code, output = serve_exits(["--model-dir", str(tmp_path)], {})
    assert code == 2, output[-2000:]
    assert "schema_version 99; this code reads schema_version 1" in output


def test_a_file_that_is_not_the_exported_one_is_named(tiny_artifacts: Path, tmp_path: Path) -> None:
    copy_model(tiny_artifacts, tmp_path)
    manifest = Manifest.read(tmp_path)
    manifest.check_files(tmp_path, ["model.onnx", "tokenizer.json", "not-listed.bin"])  # as exported: passes
    half = (tmp_path / "model.onnx").read_bytes()
    (tmp_path / "model.onnx").write_bytes(half[: len(half) // 2])  # a copy cut short
    with pytest.raises(ManifestError, match=r"model\.onnx not the file this manifest\.json was exported with"):
        manifest.check_files(tmp_path, ["model.onnx", "tokenizer.json"])
    manifest.check_files(tmp_path, ["tokenizer.json"])  # only the names asked for are read


def test_the_server_refuses_a_model_file_the_manifest_does_not_describe_with_exit_2(
    tiny_artifacts: Path, tmp_path: Path
) -> None:
    copy_model(tiny_artifacts, tmp_path)
    tokenizer = json.loads((tmp_path / "tokenizer.json").read_text())
    tokenizer["truncation"]["max_length"] -= 1  # another build's tokenizer, still a valid one
    (tmp_path / "tokenizer.json").write_text(json.dumps(tokenizer))
    code, output = serve_exits(["--model-dir", str(tmp_path)], {})
    assert code == 2, output[-2000:]
    assert "tokenizer.json not the file this manifest.json was exported with" in output
    assert "Traceback" not in output
