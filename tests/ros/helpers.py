"""Helpers shared by the SDK tests: deterministic models and digests."""

from __future__ import annotations

import torch
import xxhash


def make_model(seed: int, *, big: int = 256 * 64, small: int = 20) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tensors = {"embed.weight": torch.randn(big, generator=g).reshape(-1, 64)}
    for i in range(small):
        tensors[f"layers.{i}.norm"] = torch.randn(64, generator=g)
    tensors["head.weight"] = torch.randn(10, 64, generator=g).to(torch.bfloat16)
    return tensors


def digest(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    return {
        name: xxhash.xxh3_64_hexdigest(
            t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        )
        for name, t in sorted(tensors.items())
    }
