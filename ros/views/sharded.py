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

What the weights of one call (`quantize_shards`) cost the group: one all-reduce of flags
(which weights some rank splits a block of, whether any rank found a NaN or an infinity),
and, only when some rank splits a block, one all-reduce MAX of those weights' amax grids
back to back (each ceil(N/128) x ceil(K/128) fp32 for `fp8-block128`, N x ceil(K/32) for
`mxfp8`). A NaN or an infinity anywhere is refused by
every rank (`InvalidArgument`), so no rank is left waiting in a collective the others left.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
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


@dataclass(frozen=True)
class ShardSlice:
    """A rank's slice of a 2-D weight: `local`, at `offsets` in the weight of `shape`."""

    name: str
    local: torch.Tensor
    shape: tuple[int, int]
    offsets: tuple[int, int]


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
    return quantize_shards([ShardSlice(name, local, shape, offsets)], fmt, group)[0]


def quantize_shards(
    slices: Sequence[ShardSlice], fmt: str, group: Any = None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`quantize_shard` of each slice, with two collectives for all of them (the flags, and
    the amax grids of the weights some rank splits, back to back): every rank of `group`
    calls it with its slices of the same weights in the same order. Each weight is laid on
    its block grid twice (once for its amax, once to quantize it), so what is held at once
    beyond the outputs is one weight's fp32 buffer."""
    if fmt not in BLOCKS:
        raise InvalidArgument(f"view format {fmt!r}: one of {', '.join(BLOCKS)}")
    if not slices:
        return []
    device = slices[0].local.device
    amaxes: list[torch.Tensor] = []
    split, bad = [], -1
    for i, one in enumerate(slices):
        _check_slice(one)
        blocks = _blocks(one, fmt)[1]
        amax = (  # an empty slice (an uneven cut's last rank) touches no block
            _amax(blocks, (1, 3)) if blocks.numel() else blocks.new_zeros(blocks.shape[::2])
        )
        amaxes.append(amax)
        split.append(_splits(one, fmt))
        if bad < 0 and not bool(torch.isfinite(amax).all()):
            bad = i
    flags = torch.tensor([float(x) for x in split] + [float(bad >= 0)], device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    if bool(flags[-1]):
        if bad >= 0:
            one = slices[bad]
            raise InvalidArgument(_non_finite(one.local, one.name, *one.offsets))
        raise InvalidArgument(
            "another rank's slice holds a NaN or an infinity: a view quantizes finite weights only"
        )
    agreed = [i for i in range(len(slices)) if bool(flags[i])]
    if agreed:  # some rank splits a block of these: agree on each of their blocks' amax
        br, bc = BLOCKS[fmt]
        grids = [torch.zeros((_ceil(slices[i].shape[0], br), _ceil(slices[i].shape[1], bc)),
                             dtype=torch.float32, device=device) for i in agreed]  # fmt: skip
        ats = []
        for i, grid in zip(agreed, grids, strict=True):
            r0, c0 = slices[i].offsets[0] // br, slices[i].offsets[1] // bc
            at = grid[r0 : r0 + amaxes[i].shape[0], c0 : c0 + amaxes[i].shape[1]]
            at.copy_(amaxes[i])
            ats.append(at)
        flat = torch.cat([g.reshape(-1) for g in grids])
        dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
        at0 = 0
        for i, grid, at in zip(agreed, grids, ats, strict=True):
            grid.copy_(flat[at0 : at0 + grid.numel()].view(grid.shape))
            at0 += grid.numel()
            amaxes[i] = at
    return [_quantize(one, fmt, amax) for one, amax in zip(slices, amaxes, strict=True)]


def _check_slice(one: ShardSlice) -> None:
    n, k = _check(one.local, one.name)
    rows, cols = (int(x) for x in one.shape)
    r0, c0 = (int(x) for x in one.offsets)
    if r0 < 0 or c0 < 0 or r0 + n > rows or c0 + k > cols:
        raise InvalidArgument(
            f"{one.name}: a slice of {n}x{k} at {[r0, c0]} is not inside its weight's "
            f"{[rows, cols]}"
        )


def _blocks(one: ShardSlice, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The slice laid on its weight's block grid in fp32 (zeros around it), as (its
    elements there, the buffer viewed as blocks: block rows, rows, block columns, cols)."""
    br, bc = BLOCKS[fmt]
    n, k = int(one.local.shape[0]), int(one.local.shape[1])
    ro, co = int(one.offsets[0]) % br, int(one.offsets[1]) % bc
    buf = torch.zeros((_ceil(ro + n, br) * br, _ceil(co + k, bc) * bc), dtype=torch.float32,
                      device=one.local.device)  # fmt: skip
    x = buf[ro : ro + n, co : co + k]
    x.copy_(one.local)
    return x, buf.view(buf.shape[0] // br, br, buf.shape[1] // bc, bc)


def _splits(one: ShardSlice, fmt: str) -> bool:
    """Whether the slice holds part of a block only (its other part another rank's)."""
    br, bc = BLOCKS[fmt]
    (r0, c0), (n, k) = one.offsets, one.local.shape
    rows, cols = one.shape
    return bool(
        r0 % br or c0 % bc
        or ((r0 + n) % br and r0 + n != rows)
        or ((c0 + k) % bc and c0 + k != cols)
    )  # fmt: skip


def _quantize(one: ShardSlice, fmt: str, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The slice's e4m3 elements and its blocks' scales, from the blocks' agreed `amax`:
    the arithmetic of `ros.views.formats`, step for step."""
    x, blocks = _blocks(one, fmt)
    if fmt == "fp8-block128":
        e4m3_max = torch.tensor(E4M3_MAX, dtype=torch.float32, device=x.device)
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
