"""The contract's tests read the server tier's models (tests/onnx_tiny.py): no torch needed."""

from tests.server.conftest import tiny_artifacts

__all__ = ["tiny_artifacts"]
