"""The server's tests serve models written with onnx.helper (tests/onnx_tiny.py), not trained ones:
building them takes a second and needs neither torch nor WordNet, so this tier runs where torch cannot
be imported (`make test` runs it with tests/no_torch.py first)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.onnx_tiny import build


@pytest.fixture(scope="session")
def tiny_artifacts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default test model: 32 wide, 32 tokens, trained lengths 16 and 32, served as wordnet-encoder."""
    return build(tmp_path_factory.mktemp("onnx-tiny"))


@pytest.fixture(scope="session")
def tiny_bert_artifacts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second, different model (64 tokens, its own tokenizer and weights), named test/tiny-bert."""
    return build(
        tmp_path_factory.mktemp("onnx-tiny-second"), model_id="test/tiny-bert", dim=32, max_len=64,
        vocab_size=200, matryoshka_dims=(), seed=1,
    )  # fmt: skip
