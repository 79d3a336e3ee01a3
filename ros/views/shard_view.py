"""A rank's shard of the views of a model-parallel version (docs/views.md, "Views of
model-parallel versions"): what `make_view` is to a whole state dict, for the tensors one
rank publishes as its shard, so that the ranks' view shards put together are the view of
the whole version, bit for bit, and every rank's view manifest carries the same metadata.

Every rank of the process group calls `make_shard_views` once per publish, with the tensors
it publishes (none, for a rank that publishes no block) and their placements:

1. One `all_gather_object` of what each rank holds (each tensor's name, global shape,
   dimensions, and whether it is a block with placements), or of the error the rank met
   before (`abstain`): an error on any rank is raised by every rank (`InvalidArgument`), so
   none is left waiting in the collective that follows. From the union, every rank knows
   the same things: which weights are quantized (decided on their global shapes, as
   `make_view` decides on whole ones; one of a dtype no view quantizes, or of which a
   rank's block holds a NaN or an infinity, is refused by every rank, the holder naming the
   element), and the metadata (`quantization_config`, with its
   ignored modules, and the quantized modules' summary) of the whole version's view.
2. Per format, one `ros.views.sharded.quantize_shards` over the weights of which some
   rank's block cuts through a block of the format (every rank knows which from the
   gather), in name order, each rank giving its own block or an empty one: the scales of
   a block split across ranks agreed over the group; none when no rank cuts one. A block
   cut on block boundaries, and a weight a rank holds whole (no placements), its holder
   quantizes alone with `make_view`'s quantizer: its blocks are all its own.

What a rank's view shard holds: each quantized block as e4m3 with the weight's placements,
and the scales of the blocks whose first element lies in its block (a rectangle of the
scale grid, placed in it; none if it is empty): every scale is held by exactly one rank,
so a reader assembles the scale tensor as it assembles any split tensor. Every other
tensor is the rank's own, with its own placements.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ros.views.formats import INPUT_DTYPES
from ros.views.selection import LINEAR_MODULES, is_quantized, module_of
from ros.views.sharded import BLOCKS, ShardSlice, _non_finite, _splits, quantize_shards
from ros.views.view import view_format, view_metadata
from tensorhub.errors import InvalidArgument

Placement = tuple[tuple[int, ...], tuple[int, ...]]  # (global shape, offsets)
DTYPES = tuple(str(d) for d in INPUT_DTYPES)


@dataclass(frozen=True)
class ShardView:
    """One format's view shard: its tensors (in the rank's order), their placements and
    the view's manifest metadata (the same on every rank)."""

    tensors: dict[str, torch.Tensor]
    placements: dict[str, Placement]
    metadata: dict[str, str]


@dataclass(frozen=True)
class _Held:
    """What a rank says of one tensor it publishes."""

    name: str
    shape: tuple[int, ...]  # global
    placed: bool
    dtype: str
    offsets: tuple[int, ...] = ()  # of its block, where placed
    local: tuple[int, ...] = ()  # its block's shape, where placed
    finite: bool = True  # False: a weight a view may quantize holds a NaN or an infinity


def abstain(group: Any, error: BaseException) -> None:
    """Join `make_shard_views`'s first collective with `error` instead of tensors: for a
    rank whose publish failed before it, so that the other ranks raise instead of waiting.
    It raises nothing itself: its caller raises its own error."""
    with contextlib.suppress(InvalidArgument):
        _gather(f"{type(error).__name__}: {error}", group)


def make_shard_views(
    tensors: Mapping[str, torch.Tensor],
    placements: Mapping[str, tuple[Sequence[int], Sequence[int]]],
    formats: Sequence[str],
    group: Any = None,
    *,
    linear: frozenset[str] = LINEAR_MODULES,
) -> dict[str, ShardView]:
    """This rank's shard of each view in `formats` of a model-parallel version of which it
    publishes `tensors`, each with its `placements` (global shape, offsets) where it is a
    block (module docstring). Collective over `group` (the default group when None): every
    rank of it calls this once, in the same publish. `InvalidArgument` on every rank for
    what any rank got wrong: a weight of two global shapes, a block on one rank that another
    holds whole, a scale name already in the state dict, a NaN or an infinity in a block."""
    if not dist.is_initialized():
        raise InvalidArgument(
            "views of a model-parallel version need torch.distributed initialized: its "
            "ranks agree the scales of blocks split across them over their process group"
        )
    mine = [
        _Held(name, tuple(int(d) for d in placements[name][0]) if name in placements
              else tuple(int(d) for d in t.shape), name in placements, str(t.dtype),
              tuple(int(o) for o in placements[name][1]) if name in placements else (),
              tuple(int(d) for d in t.shape), _finite(name, t, linear))
        for name, t in tensors.items()
    ]  # fmt: skip
    everyone = _gather(mine, group)
    union = _union(everyone)
    held_by_all = [h for said in everyone if isinstance(said, list) for h in said]
    pieces = [h for h in held_by_all if h.placed]
    specs = [view_format(fmt) for fmt in formats]
    stand_ins = {name: torch.empty(held.shape, device="meta") for name, held in union.items()}
    out: dict[str, ShardView] = {}
    for spec in specs:
        quantized = sorted(
            name for name in union if is_quantized(name, stand_ins[name], spec.name, linear)
        )
        for name in quantized:  # refused by every rank alike, before any collective
            if any(h.name == name and not h.finite for h in held_by_all):
                raise InvalidArgument(_non_finite_text(name, tensors, placements))
            scale_name = f"{module_of(name)}.{spec.scale_suffix}"
            if scale_name in union:
                raise InvalidArgument(
                    f"{scale_name} is in the state dict already: the view of {name} writes it"
                )
            if union[name].dtype not in DTYPES:
                raise InvalidArgument(
                    f"{name}: {union[name].dtype}; a view quantizes bfloat16, float16 or "
                    "float32 weights"
                )
        # the weights some rank cuts through a block are agreed over the group; a block
        # every rank holds whole (a cut on block boundaries) is quantized by its holder alone
        cut = {h.name for h in pieces if h.name in quantized and _cuts_a_block(h, spec.name)}
        split = [name for name in quantized if name in cut]
        device = _device(tensors, group)
        slices = [_slice(name, tensors, placements, union[name].shape, device) for name in split]
        parts = dict(zip(split, quantize_shards(slices, spec.name, group), strict=True))
        for name in quantized:
            if union[name].placed and name not in cut and name in tensors:
                parts[name] = spec.quantize(tensors[name], name=name)
        view_tensors: dict[str, torch.Tensor] = {}
        view_placements: dict[str, Placement] = {}
        for name, tensor in tensors.items():
            placement = _placement(placements.get(name))
            if name not in quantized:
                view_tensors[name] = tensor
                if placement is not None:
                    view_placements[name] = placement
                continue
            scale_name = f"{module_of(name)}.{spec.scale_suffix}"
            if placement is None:  # held whole by this rank: quantized alone
                view_tensors[name], view_tensors[scale_name] = spec.quantize(tensor, name=name)
                continue
            q, scale = parts[name]
            view_tensors[name] = q
            view_placements[name] = placement
            owned = _owned_scales(scale, placement, tensor.shape, spec.name)
            if owned is not None:
                view_tensors[scale_name], view_placements[scale_name] = owned
        modules = [m for m in (module_of(name) for name in quantized) if m is not None]
        metadata = view_metadata(spec.name, stand_ins, modules)
        out[spec.name] = ShardView(view_tensors, view_placements, metadata)
    return out


def _gather(mine: object, group: Any) -> list[object]:
    """Every rank's `mine` (its tensors, or its error's text), in rank order; an error of
    any rank raised here on every rank."""
    size = dist.get_world_size(group)
    everyone: list[object] = [None] * size
    dist.all_gather_object(everyone, mine, group=group)
    for rank, said in enumerate(everyone):
        if isinstance(said, str):
            raise InvalidArgument(f"rank {rank} of the views' process group failed: {said}")
    return everyone


def _union(everyone: list[object]) -> dict[str, _Held]:
    """The tensors of the whole version, by name (sorted): each one's global shape, and
    whether any rank holds a block of it. `InvalidArgument` where the ranks disagree."""
    union: dict[str, _Held] = {}
    for said in everyone:
        if not isinstance(said, list):
            raise InvalidArgument(f"a rank said {type(said).__name__}: not its tensors")
        for held in said:
            if not isinstance(held, _Held):
                raise InvalidArgument(f"a rank said {type(held).__name__}: not a tensor")
            seen = union.get(held.name)
            if seen is not None and seen.shape != held.shape:
                raise InvalidArgument(
                    f"{held.name}: the ranks publish it as {list(seen.shape)} and as "
                    f"{list(held.shape)}"
                )
            if seen is not None and seen.dtype != held.dtype:
                raise InvalidArgument(
                    f"{held.name}: the ranks publish it as {seen.dtype} and as {held.dtype}"
                )
            if seen is not None and seen.placed != held.placed:
                raise InvalidArgument(
                    f"{held.name}: one rank holds a block of it (placements), another holds it "
                    "whole; a view needs one or the other on every rank"
                )
            union[held.name] = held
    return dict(sorted(union.items()))


def _slice(
    name: str,
    tensors: Mapping[str, torch.Tensor],
    placements: Mapping[str, tuple[Sequence[int], Sequence[int]]],
    shape: tuple[int, ...],
    device: torch.device,
) -> ShardSlice:
    """This rank's block of a split weight for `quantize_shards`, or an empty one on
    `device` (a rank that publishes no block of it still joins the agreement)."""
    whole = (int(shape[0]), int(shape[1]))
    if name not in placements:
        empty = torch.empty((0, 0), dtype=torch.bfloat16, device=device)
        return ShardSlice(name, empty, whole, (0, 0))
    offsets = tuple(int(o) for o in placements[name][1])
    return ShardSlice(name, tensors[name], whole, (offsets[0], offsets[1]))


def _finite(name: str, tensor: torch.Tensor, linear: frozenset[str]) -> bool:
    """False for a 2-D weight of a linear layer (one a view may quantize) that holds a NaN
    or an infinity: checked before the collectives, so that every rank refuses it."""
    module = module_of(name)
    if module is None or module.rsplit(".", 1)[-1] not in linear or tensor.dim() != 2:
        return True
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return True
    # the extremes (NaN propagates into both): one read, about 1/15 of `isfinite` on bf16
    low, high = torch.aminmax(tensor)
    return bool(torch.isfinite(low) & torch.isfinite(high))


def _non_finite_text(
    name: str,
    tensors: Mapping[str, torch.Tensor],
    placements: Mapping[str, tuple[Sequence[int], Sequence[int]]],
) -> str:
    """What a rank says of a weight some rank's block of holds a NaN or an infinity: its
    holder names the element (in the whole weight), the others the weight."""
    tensor = tensors.get(name)
    if tensor is not None and not bool(torch.isfinite(tensor).all()):
        offsets = [int(o) for o in placements[name][1]] if name in placements else [0, 0]
        return _non_finite(tensor, name, offsets[0], offsets[1])
    return (
        f"another rank's block of {name} holds a NaN or an infinity: a view quantizes "
        "finite weights only"
    )


def _cuts_a_block(held: _Held, fmt: str) -> bool:
    """Whether a rank's block of a weight holds part of a block of the format only."""
    local = torch.empty(held.local, device="meta")
    shape = (held.shape[0], held.shape[1])
    return _splits(ShardSlice(held.name, local, shape, (held.offsets[0], held.offsets[1])), fmt)


def _device(tensors: Mapping[str, torch.Tensor], group: Any) -> torch.device:
    """Where this rank's collectives run: its tensors' device, or for a rank without
    tensors the current CUDA device under NCCL (whose collectives take CUDA tensors only),
    else the CPU."""
    for tensor in tensors.values():
        return tensor.device
    if dist.get_backend(group) == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _placement(found: tuple[Sequence[int], Sequence[int]] | None) -> Placement | None:
    if found is None:
        return None
    return tuple(int(d) for d in found[0]), tuple(int(o) for o in found[1])


def _owned_scales(
    scale: torch.Tensor, placement: Placement, local: torch.Size, fmt: str
) -> tuple[torch.Tensor, Placement] | None:
    """The scales this rank publishes of its block (`quantize_shards` gave those of every
    block it touches): those of the blocks whose first element it holds, with their place
    in the weight's scale grid; None if it holds no block's first element."""
    br, bc = BLOCKS[fmt]
    (rows, cols), (r0, c0) = placement
    n, k = int(local[0]), int(local[1])
    lo_r, hi_r = -(-r0 // br), -(-(r0 + n) // br)
    lo_c, hi_c = -(-c0 // bc), -(-(c0 + k) // bc)
    if lo_r >= hi_r or lo_c >= hi_c:
        return None
    at_r, at_c = lo_r - r0 // br, lo_c - c0 // bc
    owned = scale[at_r : at_r + hi_r - lo_r, at_c : at_c + hi_c - lo_c].contiguous()
    grid = (-(-rows // br), -(-cols // bc))
    return owned, (grid, (lo_r, lo_c))
