"""A tiny encoder written with onnx.helper, and a small WordPiece tokenizer: what the server's tests serve.

No torch and no WordNet: the server's test tier builds its models from this in a second and runs where
torch cannot be imported (tests/no_torch.py). The graph has the exported encoder's contract (inputs
``input_ids`` and ``attention_mask``, int64 [batch, sequence]; output ``embeddings``, float32 [batch, dim],
the mask-aware mean, not normalised): bench/null_model.py's graph. An int8 build comes from ONNX Runtime's
dynamic quantization, as the export makes it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from bench.null_model import encoder_graph
from contract.manifest import Manifest
from model.tokenizer import save_tokenizer, train_tokenizer

FILES = ("model.onnx", "model.int8.onnx", "tokenizer.json")
TEXTS = [
    "the cat sat on the mat",
    "a small domesticated carnivore kept as a pet",
    "draw air into, and expel out of, the lungs",
    "the quiet river carries silt past the old mill while herons wait in the reeds",
    "move fast, run, walk, breathe, sleep, read, write, think",
    "the act of someone who picks up or takes something",
    "hello world, a dog, an apple, the weather today, numbers 0 1 2 3 4 5 6 7 8 9",
    "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ .,;:!?'\"()[]{}-_/\\@#$%^&*+=<>|~`",
]


def build(
    out_dir: Path,
    model_id: str = "wordnet-encoder",
    dim: int = 32,
    max_len: int = 32,
    vocab_size: int = 300,
    matryoshka_dims: tuple[int, ...] = (16, 32),
    seed: int = 0,
) -> Path:
    """Writes model.onnx, model.int8.onnx, tokenizer.json and manifest.json into out_dir."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(TEXTS, vocab_size=vocab_size, max_len=max_len)
    save_tokenizer(tokenizer, out_dir / "tokenizer.json")
    vocab = tokenizer.get_vocab_size()
    onnx.save(encoder_graph(vocab, dim, seed), out_dir / "model.onnx")
    quantize_dynamic(out_dir / "model.onnx", out_dir / "model.int8.onnx", weight_type=QuantType.QInt8)
    files = {name: hashlib.sha256((out_dir / name).read_bytes()).hexdigest() for name in FILES}
    Manifest(
        model_id=model_id,
        model_version=files["model.onnx"][:12],  # a digest prefix, as the export's
        config={"vocab_size": vocab, "max_len": max_len, "d_model": dim, "built_by": "tests/onnx_tiny.py"},
        dim=dim,
        max_length=max_len,
        vocab_size=vocab,
        pad_id=0,
        source="tests/onnx_tiny.py",
        opset=18,
        matryoshka_dims=matryoshka_dims,
        files=files,
    ).write(out_dir)
    return out_dir


def residual_then_norm(path: Path) -> Path:
    """A residual Add and the LayerNormalization after it, which ONNX Runtime's SkipLayerNormFusion makes one
    SkipLayerNormalization node unless a session is opened without it."""
    dims = ["batch", "sequence", 8]
    nodes = [
        helper.make_node("Add", ["x", "residual"], ["summed"]),
        helper.make_node("LayerNormalization", ["summed", "scale", "shift"], ["y"], axis=-1, epsilon=1e-5),
    ]
    graph = helper.make_graph(
        nodes,
        "residual_then_norm",
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, dims) for name in ("x", "residual")],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, dims)],
        [
            numpy_helper.from_array(np.ones(8, dtype=np.float32), "scale"),
            numpy_helper.from_array(np.zeros(8, dtype=np.float32), "shift"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], producer_name="tests.onnx_tiny")
    model.ir_version = 9
    onnx.save(model, path)
    return path


def optimized_op_types(monkeypatch, written: Path, module, open_session) -> list[str]:  # type: ignore[no-untyped-def]
    """The operators of the graph ``open_session()`` gets from ONNX Runtime's optimiser: every SessionOptions
    that ``module`` makes meanwhile writes its optimised graph to ``written``."""
    import onnxruntime as ort

    class WritingOptions(ort.SessionOptions):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.optimized_model_filepath = str(written)

    with monkeypatch.context() as patch:
        patch.setattr(module.ort, "SessionOptions", WritingOptions)
        open_session()
    return [node.op_type for node in onnx.load(str(written)).graph.node]
