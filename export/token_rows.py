"""The CPU graph's token-wise operators on one row per token: (B, T, d) values as (B*T, d).

ONNX Runtime runs a linear layer on a 3-D input as a MatMul and a separate Add of the bias, and the ReLU after
it as a third operator: each a pass over the activations and a dispatch of its own. On a 2-D input its graph
optimizer fuses them into one ``Gemm`` (the bias written as the product's starting value) or one ``FusedGemm``
(the activation applied as each block of the product is written): kernels it has for 2-D inputs only. This
rewrite runs every operator that treats each token alone (the linear layers, LayerNormalization, element-wise
arithmetic, activations) on (B*T, d) rows, and takes the (B, T, d) view again only where an operator needs the
sequence axis: the fused attention, the pooling. The views share the buffer (``Flatten``, ``Reshape``) and the
arithmetic is the same, so the outputs agree with the 3-D graph's to float rounding.

Which values are token-wise comes from ONNX shape inference: (batch, sequence, d), with ``input_ids``'s batch and
sequence axes and a known d.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

ROW_WISE = {"Relu", "Erf", "Tanh", "Sigmoid", "Sqrt"}  # one value in, the same shape out, element by element
ELEMENT_WISE = {"Add", "Sub", "Mul", "Div", "Pow"}  # two values in, NumPy broadcasting
BT_SHAPE = "token_rows_bt_shape"  # (B, T, -1): the shape that gives a value made as rows its (B, T, d) view


def inferred_shapes(model: onnx.ModelProto) -> dict[str, list[int | str]]:
    """Every value's shape by ONNX shape inference: an int where known, the axis's name where symbolic."""
    inferred = onnx.shape_inference.infer_shapes(model)
    values = [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]
    return {
        value.name: [dim.dim_param or dim.dim_value for dim in value.type.tensor_type.shape.dim]
        for value in values
        if value.type.tensor_type.HasField("shape")
    }


def _layer_norm_axis(node: onnx.NodeProto) -> int:
    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == "axis"), -1)  # type: ignore[return-value]


def flatten_token_rows(model: onnx.ModelProto, shapes: dict[str, list[int | str]]) -> tuple[onnx.ModelProto, int]:
    """A copy of ``model`` with its token-wise operators on (B*T, d) rows, and how many linear layers (MatMul by a
    2-D constant) now read rows. ``shapes``: ``inferred_shapes`` of this graph, or of the graph it was rewritten
    from, where inference does not know an operator (ONNX Runtime's fused Attention): names kept keep their
    shapes."""
    flat = onnx.ModelProto()
    flat.CopyFrom(model)
    graph = flat.graph
    constants = {init.name: numpy_helper.to_array(init) for init in graph.initializer}
    token_axes = shapes["input_ids"]

    def width(name: str) -> int | None:
        """d, where ``name`` is a (B, T, d) value."""
        shape = shapes.get(name)
        if shape is None or len(shape) != 3 or shape[:2] != token_axes or not isinstance(shape[2], int):
            return None
        return shape[2] or None

    def token_wise(node: onnx.NodeProto, values: list[str]) -> bool:
        out = width(node.output[0]) if len(node.output) == 1 else None
        if out is None:
            return False
        if node.op_type == "LayerNormalization":
            return _layer_norm_axis(node) in (-1, 2)
        if node.op_type in ROW_WISE:
            return len(values) == 1 and width(values[0]) == out
        if node.op_type in ELEMENT_WISE:  # no broadcasting between tokens: each value a (B, T, d) of the same d
            fixed = [name for name in node.input if name in constants]
            return all(width(v) == out for v in values) and all(constants[c].ndim <= 1 for c in fixed)
        return False

    def linear(node: onnx.NodeProto) -> bool:
        weight = constants.get(node.input[1]) if node.op_type == "MatMul" else None
        return weight is not None and weight.ndim == 2 and width(node.input[0]) is not None

    graph.initializer.append(numpy_helper.from_array(np.array([-1], dtype=np.int64), "token_rows_minus_one"))
    nodes = [
        helper.make_node("Shape", ["input_ids"], ["token_rows_bt"], name="token_rows_bt"),
        helper.make_node("Concat", ["token_rows_bt", "token_rows_minus_one"], [BT_SHAPE], axis=0, name=BT_SHAPE),
    ]
    rows: dict[str, str] = {}  # a (B, T, d) value -> its (B*T, d) rows
    made = {value.name for value in graph.input} | set(constants)  # values the rewritten graph has made so far

    def as_rows(name: str) -> str:
        if name not in rows:
            rows[name] = f"{name}_rows"
            nodes.append(helper.make_node("Flatten", [name], [rows[name]], axis=2, name=f"{name}_to_rows"))
        return rows[name]

    def as_tokens(name: str) -> None:  # the (B, T, d) view of a value made as rows only
        if name not in made:
            nodes.append(helper.make_node("Reshape", [rows[name], BT_SHAPE], [name], name=f"{name}_to_tokens"))
            made.add(name)

    linear_layers = 0
    for node in graph.node:
        values = [name for name in node.input if name and name not in constants]
        is_linear = linear(node)
        if (is_linear or token_wise(node, values)) and (is_linear or any(name in rows for name in values)):
            on_rows = onnx.NodeProto()
            on_rows.CopyFrom(node)
            del on_rows.input[:], on_rows.output[:]
            on_rows.input.extend(as_rows(name) if name in values else name for name in node.input)
            on_rows.output.append(f"{node.output[0]}_rows")
            rows[node.output[0]] = on_rows.output[0]
            nodes.append(on_rows)
            linear_layers += is_linear
            continue
        for name in values:
            as_tokens(name)
        nodes.append(node)
        made.update(node.output)
    for output in graph.output:
        as_tokens(output.name)
    del graph.node[:]
    graph.node.extend(nodes)
    onnx.checker.check_model(flat)
    return flat, linear_layers
