"""The stand-in policy every actor builds, and the digest the driver compares."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping

import torch

MiB = 1 << 20
LAYERS = 4  # the stand-in policy: LAYERS square Linear layers, sized by --model-mb
PUBLISHED = torch.bfloat16  # what rollouts run and the trainer publishes (fp32 masters)
LEARNING_RATE = 1e-6  # the stand-in step: about 2 % of the published bf16 words change


def build_model(
    model_mb: float, seed: int | None, dtype: torch.dtype = torch.float32
) -> torch.nn.Module:
    """The same architecture on every actor, `model_mb` MiB of weights in `PUBLISHED`; only
    the trainer's initial weights matter. The trainer builds it in float32 (its masters),
    the rollouts in `PUBLISHED`."""
    width = max(8, int(math.sqrt(model_mb * MiB / PUBLISHED.itemsize / LAYERS)))
    if seed is not None:
        torch.manual_seed(seed)
    layers = (torch.nn.Linear(width, width) for _ in range(LAYERS))
    return torch.nn.Sequential(*layers).to(dtype)


def digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """sha256 over every tensor's name and bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].detach().contiguous().view(torch.uint8).numpy().data)
    return h.hexdigest()
