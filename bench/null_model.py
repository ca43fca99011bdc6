"""A model that costs nothing measurable, for measuring the request path alone.

The graph is an onnx.helper encoder with the exported contract (inputs ``input_ids`` and ``attention_mask``,
output ``embeddings``, the mask-aware mean): token embeddings, one dense layer with tanh, mean pooling. Served
behind a real model's tokenizer, every request pays what serving pays (validation, tokenization, admission,
batching, the answer) and next to nothing for the model. The server's tests serve the same graph.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from contract.manifest import TOKENIZER_FILE, Manifest

NULL_DIM = 32


def encoder_graph(vocab_size: int, dim: int, seed: int) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    weights: dict[str, np.ndarray] = {
        "token_embedding": rng.normal(0, 1, (vocab_size, dim)).astype(np.float32),
        "dense_weight": rng.normal(0, dim**-0.5, (dim, dim)).astype(np.float32),
        "dense_bias": rng.normal(0, 0.1, (dim,)).astype(np.float32),
        "axis_1": np.array([1], dtype=np.int64),
        "axis_2": np.array([2], dtype=np.int64),
        "tiny": np.array(1e-9, dtype=np.float32),
    }
    nodes = [
        helper.make_node("Gather", ["token_embedding", "input_ids"], ["tokens"]),  # (B, T, D)
        helper.make_node("MatMul", ["tokens", "dense_weight"], ["projected"]),
        helper.make_node("Add", ["projected", "dense_bias"], ["biased"]),
        helper.make_node("Tanh", ["biased"], ["hidden"]),  # (B, T, D)
        helper.make_node("Cast", ["attention_mask"], ["mask"], to=TensorProto.FLOAT),  # (B, T)
        helper.make_node("Unsqueeze", ["mask", "axis_2"], ["mask3"]),  # (B, T, 1)
        helper.make_node("Mul", ["hidden", "mask3"], ["kept"]),
        helper.make_node("ReduceSum", ["kept", "axis_1"], ["summed"], keepdims=0),  # (B, D)
        helper.make_node("ReduceSum", ["mask3", "axis_1"], ["counts"], keepdims=0),  # (B, 1)
        helper.make_node("Max", ["counts", "tiny"], ["safe_counts"]),
        helper.make_node("Div", ["summed", "safe_counts"], ["embeddings"]),  # (B, D)
    ]
    graph = helper.make_graph(
        nodes,
        "tiny_encoder",
        [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"]),
            helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "sequence"]),
        ],
        [helper.make_tensor_value_info("embeddings", TensorProto.FLOAT, ["batch", dim])],
        [numpy_helper.from_array(array, name) for name, array in weights.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], producer_name="bench.null_model")
    model.ir_version = 9
    onnx.checker.check_model(model)
    return model


def build(out_dir: Path, tokenizer_of: Path, dim: int = NULL_DIM) -> Path:
    """The null model behind the tokenizer of the model folder ``tokenizer_of``, written into ``out_dir``."""
    source = Manifest.read(tokenizer_of)
    out_dir.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(tokenizer_of / TOKENIZER_FILE, out_dir / TOKENIZER_FILE)
    onnx.save(encoder_graph(source.vocab_size, dim, seed=0), out_dir / "model.onnx")
    files = {name: hashlib.sha256((out_dir / name).read_bytes()).hexdigest() for name in ("model.onnx", TOKENIZER_FILE)}
    Manifest(
        model_id="null-model",
        model_version=files["model.onnx"][:12],
        config={"vocab_size": source.vocab_size, "max_len": source.max_length, "d_model": dim},
        dim=dim,
        max_length=source.max_length,
        vocab_size=source.vocab_size,
        pad_id=source.pad_id,
        source=f"bench/null_model.py, the tokenizer of {source.model_id}",
        opset=18,
        files=files,
    ).write(out_dir)
    return out_dir
