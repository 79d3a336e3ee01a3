"""Awkward bf16 weights for the view tests: partial blocks, all-zero blocks, huge and tiny
magnitudes (bf16 subnormals too), mxfp8 blocks whose amax sits on either side of 1.75 x 2^k
(saturation), and exact e4m3 rounding ties."""

from __future__ import annotations

import numpy as np
import torch

SHAPES = [(1, 1), (1, 33), (5, 31), (127, 129), (128, 128), (129, 257), (300, 200), (257, 1000)]


def random_bf16(rows: int, cols: int, seed: int, scale: float = 0.02) -> torch.Tensor:
    """Normal weights times `scale`, in bf16."""
    gen = np.random.default_rng(seed)
    return torch.from_numpy(gen.standard_normal((rows, cols)).astype(np.float32) * scale).to(
        torch.bfloat16
    )


def awkward(rows: int, cols: int, seed: int) -> torch.Tensor:
    """A bf16 weight with every hard case the shape has room for."""
    gen = np.random.default_rng(seed)
    w = gen.standard_normal((rows, cols)).astype(np.float32)
    # Magnitudes by row band: ordinary, huge, tiny, bf16-subnormal, mixed within a block.
    bands = [0.02, 1e30, 1e-30, 1e-39, 1.0]
    for i in range(rows):
        w[i] *= bands[(i // 7) % len(bands)]
    if rows > 3 and cols > 3:
        w[rows // 2, cols // 2] *= 1e6  # one outlier: its blocks' other elements go subnormal
    if rows >= 128 and cols >= 128:
        w[:128, :128] = 0.0  # an all-zero 128x128 block (and 4 x 128 all-zero mx blocks)
    if cols >= 64:
        w[0, 32:64] = 0.0  # an all-zero mx block in a nonzero fp8-block128 block
    out = torch.from_numpy(w).to(torch.bfloat16)
    _saturation_rows(out, gen)
    _ties(out)
    return out


def _saturation_rows(w: torch.Tensor, gen: np.random.Generator) -> None:
    """Rows whose 32-blocks have amax just above, at, and just below 1.75 x 2^k."""
    rows, cols = w.shape
    for offset, amax in ((1, 1.7578125), (2, 1.75), (3, 1.7421875), (4, 1.9921875)):
        r = rows - offset
        if r < 0 or r in (0, rows // 2):
            continue
        k = int(gen.integers(-20, 20))
        vals = torch.from_numpy(gen.uniform(-1, 1, cols).astype(np.float32)) * 2.0**k
        vals[::32] = amax * 2.0**k
        w[r] = vals.to(torch.bfloat16)


def _ties(w: torch.Tensor) -> None:
    """A row whose mx blocks have amax 256 (shared exponent 0: y = x exactly) and hold
    exact e4m3 midpoints: 1.0625 (between 1 and 1.125), 1.1875, 2^-10 x 3 (subnormal), 300."""
    rows, cols = w.shape
    if rows < 6 or cols < 6:
        return
    r = rows - 5
    pattern = [256.0, 1.0625, 1.1875, -1.0625, 3 * 2.0**-10, -300.0]
    row = torch.tensor([pattern[c % len(pattern)] for c in range(cols)], dtype=torch.float32)
    w[r] = row.to(torch.bfloat16)
