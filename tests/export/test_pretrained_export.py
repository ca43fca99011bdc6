"""A BERT-family checkpoint through the same export and the same server as a trained one."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch

from embedding.v1 import embedding_pb2
from tests.conftest import ServerThread, request, server_config
from tests.model.test_pretrained import reference_embeddings
from tests.tiny_bert import MAX_SEQ_LENGTH, SENTENCES


@pytest.fixture(scope="module")
def exported(tiny_bert_artifacts: Path) -> Path:
    return tiny_bert_artifacts


def test_writes_the_artifact_contract_with_parity(exported: Path) -> None:
    manifest = json.loads((exported / "manifest.json").read_text())
    assert manifest["model_id"] == "test/tiny-bert" and "pretrained checkpoint" in manifest["source"]
    assert manifest["max_length"] == MAX_SEQ_LENGTH and manifest["normalized"] is False
    assert manifest["inputs"] == ["input_ids", "attention_mask"] and manifest["output"] == "embeddings"
    assert set(manifest["files"]) >= {
        "model.onnx",
        "model.cpu.onnx",
        "model.int8.onnx",
        "model.teacher.int8.onnx",
        "model.fp16.onnx",
        "tokenizer.json",
    }
    parity = manifest["parity"]  # eager vs TorchScript vs ONNX Runtime, and each row alone vs in a padded batch
    assert parity["passed"] is True and parity["row_alone_max_abs"]
    assert manifest["precision"]["int8 vs fp32"]["passes"]
    assert (exported / "model_repository" / "tiny-bert" / "config.pbtxt").is_file()


def padded_batch(tokenizer_json: Path) -> tuple[np.ndarray, np.ndarray]:
    """SENTENCES in one padded batch, with the exported tokenizer (it pads with the model's pad id)."""
    from tokenizers import Tokenizer

    encodings = Tokenizer.from_file(str(tokenizer_json)).encode_batch(SENTENCES)
    ids = np.array([e.ids for e in encodings], dtype=np.int64)
    return ids, np.array([e.attention_mask for e in encodings], dtype=np.int64)


@pytest.mark.parametrize("graph", ["model.onnx", "model.cpu.onnx"])
def test_onnx_model_equals_the_reference_bert(exported: Path, tiny_bert: Path, graph: str) -> None:
    ids, mask = padded_batch(exported / "tokenizer.json")
    session = ort.InferenceSession(str(exported / graph), providers=["CPUExecutionProvider"])
    (ours,) = session.run(None, {"input_ids": ids, "attention_mask": mask})
    theirs = reference_embeddings(tiny_bert, torch.from_numpy(ids), torch.from_numpy(mask)).numpy()
    assert float(np.abs(ours - theirs).max()) <= 1e-4


def test_the_server_serves_it_unchanged(exported: Path, tiny_bert: Path) -> None:
    server = ServerThread(server_config(exported))
    try:
        response = server.stub().Embed(request(*SENTENCES))
        info = server.stub().Info(embedding_pb2.InfoRequest())
    finally:
        server.stop()
    got = np.array([e.values for e in response.embeddings], dtype=np.float32)
    ids, mask = padded_batch(exported / "tokenizer.json")
    theirs = reference_embeddings(tiny_bert, torch.from_numpy(ids), torch.from_numpy(mask)).numpy()
    theirs /= np.linalg.norm(theirs, axis=1, keepdims=True)
    assert got.shape == theirs.shape
    assert float(np.abs(got - theirs).max()) <= 1e-4
    assert info.model_id == "test/tiny-bert" and info.dim == 32 and info.max_input_length == MAX_SEQ_LENGTH


def test_a_source_that_is_not_a_checkpoint_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    from export.pretrained import main

    with pytest.raises(SystemExit) as exited:
        main(["--source", str(tmp_path), "--out", str(tmp_path / "out")])
    assert "config.json not found" in str(exited.value.code)
    assert not (tmp_path / "out").exists()
