"""The stand-in policy every actor builds, and the digest the driver compares."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping

import torch

MiB = 1 << 20
LAYERS = 4  # the stand-in policy: LAYERS square Linear layers, sized by --model-mb


def build_model(model_mb: float, seed: int | None) -> torch.nn.Module:
    """The same architecture on every actor; only the trainer's initial weights matter."""
    width = max(8, int(math.sqrt(model_mb * MiB / 4 / LAYERS)))
    if seed is not None:
        torch.manual_seed(seed)
    return torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(LAYERS)))


def digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """sha256 over every tensor's name and bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].detach().contiguous().view(torch.uint8).numpy().data)
    return h.hexdigest()
