"""The CPU graph: each attention block of the exported model as ONNX Runtime's fused Attention operator."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from export.attention_fusion import export_cpu_graph, fuse_attention
from export.verify import random_batch
from tests.conftest import TINY_MODEL

HEADS, LAYERS = TINY_MODEL["n_heads"], TINY_MODEL["n_layers"]


def outputs(model: onnx.ModelProto | Path, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    source = str(model) if isinstance(model, Path) else model.SerializeToString()
    session = ort.InferenceSession(source, providers=["CPUExecutionProvider"])
    return np.asarray(session.run(["embeddings"], {"input_ids": ids, "attention_mask": mask})[0])


def op_types(model: onnx.ModelProto) -> list[str]:
    return [node.op_type for node in model.graph.node]


def test_the_cpu_graph_runs_each_attention_block_as_one_operator_with_the_same_outputs(tiny_artifacts: Path) -> None:
    cpu_graph = onnx.load(str(tiny_artifacts / "model.cpu.onnx"))
    ops = op_types(cpu_graph)
    assert ops.count("Attention") == LAYERS
    assert not {"Softmax", "Split", "Transpose"} & set(ops)  # nothing of the blocks is left beside them
    rng = np.random.default_rng(3)
    for batch, sequence in [(1, 1), (3, 17), (16, 32)]:
        ids, mask = random_batch(rng, batch, sequence, vocab_size=300, pad_id=0)
        if batch > 1:
            mask[-1, 1:], ids[-1, 1:] = 0, 0  # one real token beside full rows
        fused, plain = outputs(cpu_graph, ids, mask), outputs(tiny_artifacts / "model.onnx", ids, mask)
        assert np.abs(fused - plain).max() <= 1e-6


def test_padding_is_masked_in_the_fused_blocks(tiny_artifacts: Path) -> None:
    """A row padded with other ids gives the same embedding as the row alone: the kernel gets the mask."""
    cpu_graph = onnx.load(str(tiny_artifacts / "model.cpu.onnx"))
    ids = np.array([[5, 6, 7, 8, 9, 10]], dtype=np.int64)
    alone = outputs(cpu_graph, ids[:, :3], np.ones((1, 3), dtype=np.int64))
    padded = outputs(cpu_graph, ids, np.array([[1, 1, 1, 0, 0, 0]], dtype=np.int64))
    unmasked = outputs(cpu_graph, ids, np.ones((1, 6), dtype=np.int64))
    assert np.abs(alone - padded).max() <= 1e-6
    assert np.abs(alone - unmasked).max() > 1e-3


def scale_initializer(model: onnx.ModelProto) -> str:
    divides = [
        n for n in model.graph.node if n.op_type == "Div" and n.input[1] in {i.name for i in model.graph.initializer}
    ]
    names = {n.input[1] for n in divides if n.output[0] in {m.input[0] for m in model.graph.node if m.op_type == "Add"}}
    assert len(names) == 1, names  # the scores' scale, shared by both layers
    return names.pop()


def set_initializer(model: onnx.ModelProto, name: str, value: np.ndarray) -> None:
    for i, init in enumerate(model.graph.initializer):
        if init.name == name:
            model.graph.initializer[i].CopyFrom(
                numpy_helper.from_array(value.astype(numpy_helper.to_array(init).dtype), name)
            )


def test_a_block_that_computes_anything_else_is_left_as_it_is(tiny_artifacts: Path) -> None:
    exported = onnx.load(str(tiny_artifacts / "model.onnx"))
    assert fuse_attention(exported, HEADS)[1] == LAYERS
    assert fuse_attention(exported, HEADS * 2)[1] == 0  # the scale is not 1 / sqrt(head size)

    other_scale = onnx.ModelProto()
    other_scale.CopyFrom(exported)
    name = scale_initializer(other_scale)
    set_initializer(
        other_scale, name, numpy_helper.to_array(next(i for i in exported.graph.initializer if i.name == name)) * 2
    )
    assert fuse_attention(other_scale, HEADS)[1] == 0

    other_heads = onnx.ModelProto()
    other_heads.CopyFrom(exported)
    producers = {out: node for node in other_heads.graph.node for out in node.output}
    shapes = [producers.get(n.input[1]) for n in other_heads.graph.node if n.op_type == "Reshape"]
    split_shape = next(p for p in shapes if p is not None and len(p.input) == 4)  # (B, T, heads, head size)
    heads, head_size = split_shape.input[2], split_shape.input[3]
    # Twice the heads of half the size: the same width and the same scale constant, other attention.
    set_initializer(other_heads, heads, np.array([HEADS * 2]))
    set_initializer(other_heads, head_size, np.array([TINY_MODEL["d_model"] // (HEADS * 2)]))
    assert fuse_attention(other_heads, HEADS)[1] == 0

    other_mask = onnx.ModelProto()
    other_mask.CopyFrom(exported)
    equal = next(n for n in other_mask.graph.node if n.op_type == "Equal")
    zero = next(i for i in equal.input if i != "attention_mask")
    set_initializer(other_mask, zero, np.array(1))  # keys where the mask is 1 would get the bias
    assert fuse_attention(other_mask, HEADS)[1] == 0

    read_elsewhere = onnx.ModelProto()
    read_elsewhere.CopyFrom(exported)
    first_softmax = next(n for n in read_elsewhere.graph.node if n.op_type == "Softmax")
    read_elsewhere.graph.output.append(
        onnx.helper.make_tensor_value_info(
            first_softmax.output[0], onnx.TensorProto.FLOAT, ["batch", "heads", "sequence", "keys"]
        )
    )
    fused, count = fuse_attention(read_elsewhere, HEADS)
    assert count == LAYERS - 1  # the block whose weights are an output stays whole; the other fuses
    ids = np.array([[5, 6, 7], [8, 9, 0]], dtype=np.int64)
    mask = np.array([[1, 1, 1], [1, 1, 0]], dtype=np.int64)
    assert np.abs(outputs(fused, ids, mask) - outputs(exported, ids, mask)).max() <= 1e-6


def test_the_export_stops_when_a_layer_does_not_fuse(tiny_artifacts: Path, tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=f"0 of {LAYERS} attention blocks match"):
        export_cpu_graph(tiny_artifacts / "model.onnx", tmp_path / "model.cpu.onnx", HEADS * 2, LAYERS)
    assert not (tmp_path / "model.cpu.onnx").exists()
    export_cpu_graph(tiny_artifacts / "model.onnx", tmp_path / "model.cpu.onnx", HEADS, LAYERS)
    assert op_types(onnx.load(str(tmp_path / "model.cpu.onnx"))).count("Attention") == LAYERS
