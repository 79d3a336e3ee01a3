"""A deterministic, seed-generated model shared by tests and the holder subprocess."""

from __future__ import annotations

import torch

TENANT, MODEL = "team-a", "policy"


def make_model(
    seed: int, tiny: int = 2000, large: int = 3, large_elems: int = 60_000
) -> dict[str, torch.Tensor]:
    """`tiny` small tensors (odd sizes, mixed dtypes) plus `large` float32 tensors."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for i in range(large):
        out[f"layer.{i}.weight"] = torch.randn(large_elems, generator=g)
    for i in range(tiny):
        t = torch.randn(1 + i % 23, generator=g)
        out[f"norm.{i}"] = t.to(torch.bfloat16) if i % 3 == 0 else t
    return out
