"""A pytest plugin that makes torch unimportable: `pytest -p tests.no_torch` proves a test tier needs none.

`make test` runs the server's tier this way (tests/server, tests/contract, tests/deploy, the layer rules),
then everything else with torch.
"""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType


class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(
        self, name: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"{name} is not importable in this test tier (tests/no_torch.py)")
        return None


def pytest_configure() -> None:
    if any(m == "torch" or m.startswith("torch.") for m in sys.modules):
        raise RuntimeError("torch was imported before tests/no_torch.py could keep it out")
    sys.meta_path.insert(0, NoTorch())
