"""The exported graph with each self-attention block as one ONNX Runtime ``Attention`` operator: the graph
the server's CPU sessions run (``model.cpu.onnx``, decisions/0026).

ONNX Runtime matches none of the standard graph's attention blocks to its fused kernel, whose patterns are
BERT's as Hugging Face exports it. This rewrite puts the kernel in their place, block by block, after
checking that the block computes exactly what the kernel does:

    softmax(Q K^T / sqrt(C / num_heads) + (attention_mask == 0) * mask_value) V, heads side by side again.

A block that differs in any part is left as it is. Every value stays fp32, so the outputs agree with
``model.onnx`` (export/verify.py checks them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import onnx
from onnx import helper, numpy_helper

MICROSOFT = "com.microsoft"
MASK_INPUT = "attention_mask"
MASK_INT32 = "attention_mask_int32"  # the kernel's raw (B, T) mask: 1 attends, 0 is padding
HEADS_FIRST = [0, 2, 1, 3]  # (B, T, nh, hs) <-> (B, nh, T, hs)
KEYS_TRANSPOSED = [0, 2, 3, 1]  # (B, T, nh, hs) -> (B, nh, hs, T)


class _Graph:
    """Who makes and who reads each value, and the constants' values."""

    def __init__(self, graph: onnx.GraphProto) -> None:
        self.producer = {out: node for node in graph.node for out in node.output}
        self.readers: dict[str, list[onnx.NodeProto]] = {}
        for node in graph.node:
            for name in node.input:
                self.readers.setdefault(name, []).append(node)
        self.constants = {init.name: numpy_helper.to_array(init) for init in graph.initializer}
        for node in graph.node:
            if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
                self.constants[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)
        self.outputs = {out.name for out in graph.output}

    def made_by(self, name: str, op_type: str) -> onnx.NodeProto | None:
        node = self.producer.get(name)
        return node if node is not None and node.op_type == op_type else None

    def scalar(self, name: str) -> float | None:
        value = self.constants.get(name)
        return float(value) if value is not None and value.size == 1 else None


def _attribute(node: onnx.NodeProto, name: str) -> object:
    for attribute in node.attribute:
        if attribute.name == name:
            return helper.get_attribute_value(attribute)
    return None


@dataclass(frozen=True)
class _Block:
    """One attention block as the rewrite found it: what the fused node needs, and the nodes it replaces."""

    x: str  # (B, T, C): the block's input
    weight: str  # (C, 3C)
    bias: str  # (3C,)
    scale: float  # what the scores are divided by
    mask_value: float  # what a padded key's score gets added
    output: str  # (B, T, C): heads side by side again
    nodes: tuple[onnx.NodeProto, ...]  # replaced, from the Q/K/V product to the last reshape


def _last_dims(g: _Graph, shape: str, count: int) -> list[int] | None:
    """The last ``count`` entries of a Reshape's target shape, where they are constants: the shape itself a
    constant, or the Concat of pieces whose last ones are (the exporter's (B, T, ...) with B and T read at run
    time)."""
    if shape in g.constants:
        return [int(v) for v in g.constants[shape].ravel().tolist()[-count:]]
    concat = g.made_by(shape, "Concat")
    if concat is None:
        return None
    dims: list[int] = []
    for piece in reversed(concat.input):
        value = g.constants.get(piece)
        if value is None:
            break
        dims[:0] = [int(v) for v in value.ravel().tolist()]
    return dims[-count:] if len(dims) >= count else None


def _heads(g: _Graph, name: str, perm: list[int], heads: list[int]) -> tuple[str, list[onnx.NodeProto]] | None:
    """``name`` made by Transpose(perm) of a Reshape to (B, T, *heads): the reshaped value and the two nodes."""
    transpose = g.made_by(name, "Transpose")
    if transpose is None or list(_attribute(transpose, "perm") or []) != perm:  # type: ignore[call-overload]
        return None
    reshape = g.made_by(transpose.input[0], "Reshape")
    if reshape is None or _last_dims(g, reshape.input[1], 2) != heads:
        return None
    return reshape.input[0], [reshape, transpose]


def _padding_bias(g: _Graph, name: str) -> float | None:
    """The value added to padded keys' scores, if ``name`` is Cast(Unsqueeze(attention_mask == 0, [1, 2]))
    times a constant: a (B, 1, 1, T) bias from the graph's own mask input."""
    mul = g.made_by(name, "Mul")
    if mul is None:
        return None
    for factor, other in ((mul.input[1], mul.input[0]), (mul.input[0], mul.input[1])):
        value = g.scalar(factor)
        cast = g.made_by(other, "Cast")
        if value is None or cast is None:
            continue
        unsqueeze = g.made_by(cast.input[0], "Unsqueeze")
        if unsqueeze is None or len(unsqueeze.input) < 2:
            continue
        axes = g.constants.get(unsqueeze.input[1])
        equal = g.made_by(unsqueeze.input[0], "Equal")
        if axes is None or sorted(axes.ravel().tolist()) != [1, 2] or equal is None:
            continue
        others = [i for i in equal.input if i != MASK_INPUT]
        if len(equal.input) == 2 and len(others) == 1 and g.scalar(others[0]) == 0.0:
            return value
    return None


def _block(g: _Graph, softmax: onnx.NodeProto, num_heads: int) -> _Block | None:
    """The attention block around ``softmax``, or None where any part differs from what the kernel does."""
    if _attribute(softmax, "axis") not in (-1, 3):
        return None
    add = g.made_by(softmax.input[0], "Add")
    if add is None:
        return None
    for scores_name, bias_name in ((add.input[0], add.input[1]), (add.input[1], add.input[0])):
        mask_value = _padding_bias(g, bias_name)
        divide = g.made_by(scores_name, "Div")
        if mask_value is not None and divide is not None:
            break
    else:
        return None
    scale = g.scalar(divide.input[1])
    product = g.made_by(divide.input[0], "MatMul")
    readers = g.readers.get(softmax.output[0], [])
    if scale is None or product is None or len(readers) != 1 or readers[0].op_type != "MatMul":
        return None
    weighted = readers[0]
    if weighted.input[0] != softmax.output[0]:
        return None
    head_size = round(scale**2)  # the scale is sqrt(head size), checked against the weight's width below
    heads = [num_heads, head_size]
    q, k = _heads(g, product.input[0], HEADS_FIRST, heads), _heads(g, product.input[1], KEYS_TRANSPOSED, heads)
    v = _heads(g, weighted.input[1], HEADS_FIRST, heads)
    if q is None or k is None or v is None:
        return None
    split = g.made_by(q[0], "Split")
    if split is None or list(split.output) != [q[0], k[0], v[0]] or _attribute(split, "axis") not in (-1, 2):
        return None
    if len(split.input) > 1 and split.input[1]:  # explicit sizes: they must be three equal parts
        sizes = g.constants.get(split.input[1])
        if sizes is None or len(set(sizes.ravel().tolist())) != 1:
            return None
    bias_add = g.made_by(split.input[0], "Add")
    if bias_add is None:
        return None
    matmul = g.made_by(bias_add.input[0], "MatMul")
    bias = bias_add.input[1]
    if matmul is None:
        matmul, bias = g.made_by(bias_add.input[1], "MatMul"), bias_add.input[0]
    if matmul is None:
        return None
    weight = g.constants.get(matmul.input[1])
    bias_value = g.constants.get(bias)
    if weight is None or bias_value is None or weight.ndim != 2 or bias_value.shape != (weight.shape[1],):
        return None
    width = weight.shape[0]
    if weight.shape[1] != 3 * width or width % num_heads:
        return None
    if not math.isclose(scale, math.sqrt(width // num_heads), rel_tol=1e-6):
        return None
    back = g.readers.get(weighted.output[0], [])
    if len(back) != 1 or back[0].op_type != "Transpose" or list(_attribute(back[0], "perm") or []) != HEADS_FIRST:  # type: ignore[call-overload]
        return None
    merge = g.readers.get(back[0].output[0], [])
    if len(merge) != 1 or merge[0].op_type != "Reshape" or _last_dims(g, merge[0].input[1], 1) != [width]:
        return None
    nodes = (matmul, bias_add, split, *q[1], *k[1], *v[1], product, divide, add, softmax, weighted, back[0], merge[0])
    members = {id(node) for node in nodes}
    for node in nodes[:-1]:  # every intermediate read only inside the block
        for out in node.output:
            if out in g.outputs or any(id(r) not in members for r in g.readers.get(out, [])):
                return None
    return _Block(matmul.input[0], matmul.input[1], bias, scale, mask_value, merge[0].output[0], nodes)


def _drop_unread(graph: onnx.GraphProto) -> None:
    """Nodes whose outputs nothing reads (the padding bias's chain, once no block adds it), then unread
    initializers."""
    outputs = {out.name for out in graph.output}
    while True:
        read = {name for node in graph.node for name in node.input} | outputs
        keep = [node for node in graph.node if any(out in read for out in node.output)]
        if len(keep) == len(graph.node):
            break
        del graph.node[:]
        graph.node.extend(keep)
    read = {name for node in graph.node for name in node.input} | outputs
    kept = [init for init in graph.initializer if init.name in read]
    del graph.initializer[:]
    graph.initializer.extend(kept)


def fuse_attention(model: onnx.ModelProto, num_heads: int) -> tuple[onnx.ModelProto, int]:
    """A copy of ``model`` with every attention block that matches as one ``Attention`` node, and how many
    blocks were fused (0: the copy computes as the original, node for node)."""
    fused = onnx.ModelProto()
    fused.CopyFrom(model)
    g = _Graph(fused.graph)
    blocks = [b for b in (_block(g, n, num_heads) for n in fused.graph.node if n.op_type == "Softmax") if b]
    if not blocks:
        return fused, 0
    replaced = {id(node) for block in blocks for node in block.nodes}
    first_of = {id(block.nodes[0]): block for block in blocks}
    nodes: list[onnx.NodeProto] = [
        helper.make_node("Cast", [MASK_INPUT], [MASK_INT32], to=onnx.TensorProto.INT32, name="attention_mask_cast")
    ]
    for node in fused.graph.node:
        block = first_of.get(id(node))
        if block is not None:  # where its Q/K/V product was: every input is ready there
            nodes.append(_attention_node(block, num_heads, len(nodes)))
        if id(node) not in replaced:
            nodes.append(node)
    del fused.graph.node[:]
    fused.graph.node.extend(nodes)
    _drop_unread(fused.graph)
    if not any(opset.domain == MICROSOFT for opset in fused.opset_import):
        fused.opset_import.append(helper.make_opsetid(MICROSOFT, 1))
    onnx.checker.check_model(fused)
    return fused, len(blocks)


def _attention_node(block: _Block, num_heads: int, index: int) -> onnx.NodeProto:
    return helper.make_node(
        "Attention",
        [block.x, block.weight, block.bias, MASK_INT32],
        [block.output],
        domain=MICROSOFT,
        name=f"attention_{index}",
        num_heads=num_heads,
        scale=1.0 / block.scale,
        mask_filter_value=block.mask_value,
    )


def export_cpu_graph(onnx_path: Path, out: Path, num_heads: int, layers: int) -> Path:
    """Writes ``onnx_path`` with its attention blocks fused to ``out``. Every one of the encoder's ``layers``
    must fuse: a block that no longer matches means the exporter or the model changed the graph, and the
    export stops rather than serve a CPU graph that is silently the slow one."""
    fused, count = fuse_attention(onnx.load(str(onnx_path)), num_heads)
    if count != layers:
        raise RuntimeError(
            f"{onnx_path}: {count} of {layers} attention blocks match ONNX Runtime's Attention operator; "
            "export/attention_fusion.py says what it matches"
        )
    onnx.save(fused, str(out))
    return out
