"""A Triton Inference Server model repository for the exported ONNX model.

    <model_dir>/model_repository/<name>/config.pbtxt
    <model_dir>/model_repository/<name>/1/model.onnx

Triton's ONNX Runtime backend then serves the same graph with its own dynamic batcher: batch is
implicit (max_batch_size > 0), sequence is -1 (dynamic), outputs are the un-normalised embeddings.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import onnx

TYPES: dict[int, str] = {onnx.TensorProto.INT64: "TYPE_INT64", onnx.TensorProto.FLOAT: "TYPE_FP32"}


def _dims(value: onnx.ValueInfoProto) -> list[int]:
    """Dims after the batch axis: -1 where the ONNX graph has a symbolic (dynamic) size."""
    return [d.dim_value if d.dim_value else -1 for d in value.type.tensor_type.shape.dim[1:]]


def config_pbtxt(onnx_path: Path, name: str, max_batch_size: int, max_queue_delay_us: int = 2000) -> str:
    graph = onnx.load(str(onnx_path), load_external_data=False).graph

    def tensor(value: onnx.ValueInfoProto) -> str:
        dims = ", ".join(str(d) for d in _dims(value))
        return f'  {{ name: "{value.name}" data_type: {TYPES[value.type.tensor_type.elem_type]} dims: [ {dims} ] }}'

    return "\n".join(
        [
            f'name: "{name}"',
            'platform: "onnxruntime_onnx"',
            f"max_batch_size: {max_batch_size}",
            "input [",
            ",\n".join(tensor(v) for v in graph.input),
            "]",
            "output [",
            ",\n".join(tensor(v) for v in graph.output),
            "]",
            "dynamic_batching {",
            f"  max_queue_delay_microseconds: {max_queue_delay_us}",
            "}",
            "instance_group [ { count: 1 kind: KIND_AUTO } ]",
            "",
        ]
    )


def write_triton_repository(model_dir: Path, name: str, max_batch_size: int = 128) -> Path:
    repository = model_dir / "model_repository" / name
    (repository / "1").mkdir(parents=True, exist_ok=True)
    shutil.copyfile(model_dir / "model.onnx", repository / "1" / "model.onnx")
    (repository / "config.pbtxt").write_text(config_pbtxt(model_dir / "model.onnx", name, max_batch_size))
    return repository
