"""TorchScript export: ``torch.jit.script`` of the encoder, loadable with ``torch.jit.load`` alone."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from model.transformer import Encoder


def script(model: Encoder) -> torch.jit.ScriptModule:
    # torch 2.13 deprecates TorchScript in favour of torch.export; the artifact is still a product
    # requirement, so this one warning is silenced on purpose (and filtered in pytest's settings).
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*(TorchScript|torch\.jit).*", category=DeprecationWarning)
        warnings.filterwarnings("ignore", message=r".*(TorchScript|torch\.jit).*deprecat.*")
        return torch.jit.script(model.eval())


def export_torchscript(model: Encoder, path: Path | str) -> Path:
    scripted = script(model)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*(TorchScript|torch\.jit).*")
        torch.jit.save(scripted, str(path))
    return Path(path)


def load_torchscript(path: Path | str) -> torch.jit.ScriptModule:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*(TorchScript|torch\.jit).*")
        return torch.jit.load(str(path), map_location="cpu")
