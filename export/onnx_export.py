"""ONNX export with the dynamo exporter: dynamic batch and sequence axes, checked by onnx.checker."""

from __future__ import annotations

import itertools
import logging
import warnings
from pathlib import Path

import onnx
import torch

from model.transformer import Encoder

OPSET = 18
INPUT_NAMES = ("input_ids", "attention_mask")
OUTPUT_NAME = "embeddings"
STACK_TRACE = "pkg.torch.onnx.stack_trace"  # node metadata the dynamo exporter writes


def export_onnx(model: Encoder, path: Path | str, opset: int = OPSET) -> Path:
    model = model.eval()
    # A sample with batch and sequence > 1 so neither axis gets specialised to a constant.
    input_ids = torch.randint(1, model.config.vocab_size, (3, 11), dtype=torch.long)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, 7:] = 0
    batch = torch.export.Dim("batch", min=1, max=4096)
    sequence = torch.export.Dim("sequence", min=1, max=model.max_len)
    dynamic_shapes = ({0: batch, 1: sequence}, {0: batch, 1: sequence})
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)  # e.g. "torchvision is not installed"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporter's progress chatter, not problems with the graph
        program = torch.onnx.export(
            model,
            (input_ids, attention_mask),
            dynamo=True,
            dynamic_shapes=dynamic_shapes,
            input_names=list(INPUT_NAMES),
            output_names=[OUTPUT_NAME],
            opset_version=opset,
            optimize=True,
            verbose=False,
        )
    assert program is not None
    # Each node's stack trace names the source file by its absolute path: the served model would carry the
    # builder's directory, and two clones of one commit would build different bytes. The rest of the node
    # metadata (module names and scopes, which profilers show) does not depend on where the code lives.
    functions = program.model.functions.values()
    for node in itertools.chain(program.model.graph.all_nodes(), *(f.all_nodes() for f in functions)):
        node.metadata_props.pop(STACK_TRACE, None)
    program.save(str(path))
    onnx_model = onnx.load(str(path))
    onnx.checker.check_model(onnx_model, full_check=True)
    return Path(path)


def onnx_opset(path: Path | str) -> int:
    model = onnx.load(str(path), load_external_data=False)
    return next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
