"""The CPU graph's token-wise operators on one row per token (export/token_rows.py)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from contract.manifest import CPU_DISABLED_OPTIMIZERS
from export import attention_fusion
from export.attention_fusion import export_cpu_graph
from export.token_rows import flatten_token_rows, inferred_shapes
from tests.conftest import TINY_MODEL

LAYERS = TINY_MODEL["n_layers"]
WIDTH = 4


def session(model: onnx.ModelProto | Path, optimized: Path | None = None) -> ort.InferenceSession:
    options = ort.SessionOptions()
    if optimized is not None:
        options.optimized_model_filepath = str(optimized)
    source = str(model) if isinstance(model, Path) else model.SerializeToString()
    return ort.InferenceSession(
        source, options, providers=["CPUExecutionProvider"], disabled_optimizers=list(CPU_DISABLED_OPTIMIZERS)
    )


def linear_then_masked(weight_is_constant: bool = True) -> onnx.ModelProto:
    """tokens (B, T, 4) -> x @ W + b -> ReLU -> + tokens (a residual) -> times the mask (B, T, 1)."""
    rng = np.random.default_rng(0)
    constants = [numpy_helper.from_array(rng.standard_normal(WIDTH).astype(np.float32), "b")]
    inputs = [
        helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"]),
        helper.make_tensor_value_info("tokens", TensorProto.FLOAT, ["batch", "sequence", WIDTH]),
        helper.make_tensor_value_info("mask", TensorProto.FLOAT, ["batch", "sequence", 1]),
    ]
    weight = numpy_helper.from_array(rng.standard_normal((WIDTH, WIDTH)).astype(np.float32), "W")
    if weight_is_constant:
        constants.append(weight)
    else:
        inputs.append(helper.make_tensor_value_info("W", TensorProto.FLOAT, [WIDTH, WIDTH]))
    nodes = [
        helper.make_node("MatMul", ["tokens", "W"], ["product"]),
        helper.make_node("Add", ["product", "b"], ["linear"]),
        helper.make_node("Relu", ["linear"], ["relu"]),
        helper.make_node("Add", ["relu", "tokens"], ["residual"]),
        helper.make_node("Mul", ["residual", "mask"], ["out"]),
    ]
    output = helper.make_tensor_value_info("out", TensorProto.FLOAT, ["batch", "sequence", WIDTH])
    graph = helper.make_graph(nodes, "linear_then_masked", inputs, [output], constants)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def feed(model: onnx.ModelProto, batch: int, sequence: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    values = {
        "input_ids": np.zeros((batch, sequence), dtype=np.int64),
        "tokens": rng.standard_normal((batch, sequence, WIDTH)).astype(np.float32),
        "mask": (rng.random((batch, sequence, 1)) > 0.3).astype(np.float32),
        "W": rng.standard_normal((WIDTH, WIDTH)).astype(np.float32),
    }
    return {value.name: values[value.name] for value in model.graph.input}


def test_token_wise_operators_run_on_rows_and_a_product_with_a_narrower_value_gets_the_token_view() -> None:
    """The rewrite flattens only values of an operator's own width: the mask's product stays on tokens."""
    model = linear_then_masked()
    rows, linear_layers = flatten_token_rows(model, inferred_shapes(model))
    assert linear_layers == 1
    ops = Counter(node.op_type for node in rows.graph.node)
    assert ops["Flatten"] == 1  # tokens, once, though the product and the residual both read it as rows
    assert ops["Reshape"] == 1  # the residual's (B, T, d) view for the mask's product
    made_as_rows = {node.output[0] for node in rows.graph.node if node.op_type in {"MatMul", "Add", "Relu"}}
    mul = next(node for node in rows.graph.node if node.op_type == "Mul")
    assert mul.input[0] not in made_as_rows
    for batch, sequence in [(1, 1), (3, 7)]:
        expected = session(model).run(None, feed(model, batch, sequence))[0]
        got = session(rows).run(None, feed(rows, batch, sequence))[0]
        assert got.shape == (batch, sequence, WIDTH)
        assert np.abs(got - expected).max() <= 1e-6


def test_a_product_by_a_value_that_is_not_a_constant_weight_is_left_on_tokens() -> None:
    model = linear_then_masked(weight_is_constant=False)
    rows, linear_layers = flatten_token_rows(model, inferred_shapes(model))
    assert linear_layers == 0
    assert [n.op_type for n in rows.graph.node if n.op_type not in {"Shape", "Concat"}] == [
        n.op_type for n in model.graph.node
    ]


def test_onnx_runtime_runs_the_cpu_graphs_linear_layers_as_one_gemm_each(tiny_artifacts: Path, tmp_path: Path) -> None:
    """The rewrite's point: with rows, ONNX Runtime fuses each linear layer's product, bias and ReLU into one
    kernel. On model.onnx it fuses none of them."""
    for graph, gemms in [("model.cpu.onnx", 3 * LAYERS), ("model.onnx", 0)]:
        optimized = tmp_path / f"optimized.{graph}"
        session(tiny_artifacts / graph, optimized)
        ops = Counter(node.op_type for node in onnx.load(str(optimized)).graph.node)
        assert ops["Gemm"] + ops["FusedGemm"] == gemms, (graph, ops)
        assert ops["Relu"] == (0 if gemms else LAYERS)


def test_the_export_stops_when_a_linear_layer_does_not_read_rows(
    tiny_artifacts: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def one_fewer_on_rows(model: onnx.ModelProto, shapes: object) -> tuple[onnx.ModelProto, int]:
        rows, linear_layers = flatten_token_rows(model, shapes)  # type: ignore[arg-type]
        return rows, linear_layers - 1

    monkeypatch.setattr(attention_fusion, "flatten_token_rows", one_fewer_on_rows)
    with pytest.raises(RuntimeError, match=f"{3 * LAYERS - 1} of {3 * LAYERS} linear layers"):
        export_cpu_graph(tiny_artifacts / "model.onnx", tmp_path / "model.cpu.onnx", TINY_MODEL["n_heads"], LAYERS)
    assert not (tmp_path / "model.cpu.onnx").exists()
