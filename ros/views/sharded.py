"""A rank's part of a view of a model-parallel weight (docs/views.md, "Views of
model-parallel weights"): each rank quantizes its own slice of a weight, and a block that
the slices split across ranks gets one scale, agreed by the ranks over their process group,
so that the ranks' parts put together are the view of the whole weight, bit for bit.

A block's scale depends only on its amax (`ros.views.formats`), and the amax of a block is
the max of the amaxes of its pieces. So each rank lays its slice on the whole weight's
block grid (zeros where it holds nothing of a block: a zero changes no amax), takes the
amax of each block it touches, and the ranks agree on each block's amax with one all-reduce
MAX over the group; each then scales and rounds its own elements against the agreed scale.
Every element is divided (or scaled) and rounded exactly as the whole weight's quantizer
does it, so the bits are the same.

What one weight costs the group: one all-reduce of two flags (does any rank split a block,
did any rank find a NaN or an infinity), and, only when some rank splits a block, one
all-reduce MAX of the whole weight's amax grid (ceil(N/128) x ceil(K/128) fp32 for
`fp8-block128`; N x ceil(K/32) for `mxfp8`). A NaN or an infinity anywhere is refused by
every rank (`InvalidArgument`), so no rank is left waiting in a collective the others left.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ros.views.formats import (
    AMAX_FLOOR,
    BLOCK,
    E4M3,
    E4M3_MAX,
    E8M0_BIAS,
    MX_BLOCK,
    _amax,
    _check,
    pow2,
    shared_exponent,
)
from tensorhub.errors import InvalidArgument

BLOCKS = {"fp8-block128": (BLOCK, BLOCK), "mxfp8": (1, MX_BLOCK)}  # rows x cols of a block


def quantize_shard(
    local: torch.Tensor,
    shape: tuple[int, int],
    offsets: tuple[int, int],
    fmt: str,
    group: Any = None,
    *,
    name: str = "weight",
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of the `fmt` view of a weight of global `shape`, of which it holds
    `local` at `offsets`: e4m3 `q` of `local`'s shape, and the scales of the blocks `local`
    touches (`fp8-block128`: fp32, block rows [r0 // 128, ceil((r0 + n) / 128)) by block
    columns likewise; `mxfp8`: uint8 e8m0, rows [r0, r0 + n) by block columns
    [c0 // 32, ceil((c0 + k) / 32))), equal to those parts of the whole weight's view.
    Collective: every rank of `group` (the default group when None) calls it for the same
    weight in the same order. `InvalidArgument` for a format, a slice outside `shape`, or
    a NaN or infinity on any rank."""
    if fmt not in BLOCKS:
        raise InvalidArgument(f"view format {fmt!r}: one of {', '.join(BLOCKS)}")
    n, k = _check(local, name)
    rows, cols = (int(x) for x in shape)
    r0, c0 = (int(x) for x in offsets)
    if r0 < 0 or c0 < 0 or r0 + n > rows or c0 + k > cols:
        raise InvalidArgument(
            f"{name}: a slice of {n}x{k} at {[r0, c0]} is not inside its weight's {[rows, cols]}"
        )
    br, bc = BLOCKS[fmt]
    ro, co = r0 % br, c0 % bc
    buf = torch.zeros(
        (_ceil(ro + n, br) * br, _ceil(co + k, bc) * bc), dtype=torch.float32, device=local.device
    )
    x = buf[ro : ro + n, co : co + k]
    x.copy_(local)
    blocks = buf.view(buf.shape[0] // br, br, buf.shape[1] // bc, bc)
    amax = _amax(blocks, (1, 3))
    split = bool(ro or co) or ((r0 + n) % br != 0 and r0 + n != rows)
    split = split or ((c0 + k) % bc != 0 and c0 + k != cols)
    bad = not bool(torch.isfinite(amax).all())
    flags = torch.tensor([float(split), float(bad)], device=local.device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    if bool(flags[1]):
        raise InvalidArgument(_non_finite(local, name, r0, c0) if bad else (
            f"{name}: another rank's slice holds a NaN or an infinity: a view quantizes "
            "finite weights only"
        ))  # fmt: skip
    if bool(flags[0]):  # some rank splits a block: agree on every block's amax
        grid = torch.zeros((_ceil(rows, br), _ceil(cols, bc)), dtype=torch.float32,
                           device=local.device)  # fmt: skip
        at = grid[r0 // br : r0 // br + amax.shape[0], c0 // bc : c0 // bc + amax.shape[1]]
        at.copy_(amax)
        dist.all_reduce(grid, op=dist.ReduceOp.MAX, group=group)
        amax = at
    if fmt == "fp8-block128":
        e4m3_max = torch.tensor(E4M3_MAX, dtype=torch.float32, device=local.device)
        scale = amax.clamp(min=AMAX_FLOOR) / e4m3_max
        torch.div(blocks, scale[:, None, :, None], out=blocks).clamp_(-E4M3_MAX, E4M3_MAX)
    else:
        shared = shared_exponent(amax)
        blocks.mul_(pow2(-shared)[:, None, :, None]).clamp_(-E4M3_MAX, E4M3_MAX)
        scale = (shared + E8M0_BIAS).to(torch.uint8)
    return x.to(E4M3), scale.contiguous()


def _non_finite(local: torch.Tensor, name: str, r0: int, c0: int) -> str:
    r, c = (int(i) for i in (~torch.isfinite(local)).nonzero()[0])
    return (
        f"{name}[{r0 + r}, {c0 + c}] is {float(local[r, c])}: a view quantizes finite weights only"
    )


def _ceil(n: int, d: int) -> int:
    return -(-n // d)
