"""The benchmark model: deterministic bytes from a seed, so every receiver can be checked.

Eight large float32 tensors plus 64 small ones (the shape of a real state dict: a few big
matrices and many norms). `digest` hashes the bytes in layout order; two sides agree on
it only if every byte arrived intact.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import xxhash

from transport.layout import Layout

SMALL = 64
SMALL_ELEMS = 256


def _shapes(nbytes: int) -> dict[str, tuple[int, ...]]:
    big = max(1, (nbytes - SMALL * SMALL_ELEMS * 4) // 4 // 8)
    return {
        **{f"layer.{i}.weight": (big,) for i in range(8)},
        **{f"layer.{i}.norm": (SMALL_ELEMS,) for i in range(SMALL)},
    }


def make_model(nbytes: int, seed: int) -> dict[str, torch.Tensor]:
    """About `nbytes` bytes of float32 drawn from `seed` (the same on every host)."""
    gen = torch.Generator().manual_seed(seed)
    return {
        name: torch.randint(-(2**31), 2**31 - 1, shape, generator=gen, dtype=torch.int32).view(
            torch.float32
        )
        for name, shape in _shapes(nbytes).items()
    }


def model_layout(nbytes: int, chunk: int) -> Layout:
    """The layout of `make_model(nbytes, ·)` without generating its bytes."""
    empty = {n: torch.empty(s, dtype=torch.float32) for n, s in _shapes(nbytes).items()}
    return Layout.from_tensors(empty, chunk_size=chunk)


def flat(nbytes: int, seed: int) -> torch.Tensor:
    """The model's bytes as one uint8 tensor (for baselines that move one buffer)."""
    parts = [t.view(torch.uint8).reshape(-1) for t in make_model(nbytes, seed).values()]
    return torch.cat(parts)


def digest(tensors: Mapping[str, torch.Tensor] | torch.Tensor) -> str:
    """xxh3-64 of the bytes, tensor by tensor in mapping order (hex)."""
    hasher = xxhash.xxh3_64()
    items = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors.values())
    for t in items:
        hasher.update(t.contiguous().view(torch.uint8).reshape(-1).numpy().data)
    return hasher.hexdigest()
