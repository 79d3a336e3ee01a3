"""DTensor state dicts published as shards: each rank's blocks, derived from mesh and placements.

FSDP2 (`fully_shard`) and tensor parallelism (`parallelize_module`) hand out state dicts of
DTensors. Published as they are, every rank publishes its own local tensors, with no gather
and no copy: the local tensor (`DTensor.to_local()`) is the memory the rank serves. What a
model-parallel publish needs besides is derived here, from metadata every rank has of every
DTensor (its global shape, device mesh and placements), so the ranks agree without talking:

- the block of each global tensor a rank holds (`block`): `Shard(d)` on a mesh dimension
  splits tensor dimension d as `torch.chunk` does (uneven sizes, the last shards smaller or
  empty: FSDP2's); several mesh dimensions sharding one tensor dimension split it in turn,
  left to right (or in the order the DTensor records); `Replicate` leaves it whole;
- which rank publishes a block held by several (a replicated tensor, or a sharded one on a
  mesh with `Replicate` dimensions: one block per replica group): one rank of the group,
  chosen by the tensor's position among the names, so the replicated tensors spread over
  the group's ranks rather than all landing on one; an empty block is published by nobody;
- the shard each rank publishes: the ranks that publish anything, in global rank order, are
  shards 0..n-1 of the version. A rank that publishes nothing (a replica that owns no block)
  is no shard at all.

A plain tensor in a state dict that has DTensors (e.g. a norm's weight left whole by
`parallelize_module`) is replicated over every rank of the DTensors' meshes. Refused with
`InvalidArgument`: `Partial` placements (no value until reduced), `_StridedShard` (a rank's
part of the tensor is not one block), a local tensor whose shape is not the derived one.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist

from ros.client.manifest import Placements
from tensorhub.errors import InvalidArgument

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def _dtensor() -> type[DTensor] | None:
    """DTensor's class if `torch.distributed.tensor` is loaded, else None: no tensor is a
    DTensor before that module is imported, and importing it costs every publisher a second
    or more (16 ranks starting at once on 2 cores: about 8 s before the first publish)."""
    module = sys.modules.get("torch.distributed.tensor")
    return None if module is None else cast("type[DTensor]", module.DTensor)


Order = Sequence[tuple[int, Sequence[int]]]  # (tensor dim, the mesh dims splitting it, in turn)


@dataclass(frozen=True)
class RankShard:
    """What one rank publishes of a DTensor state dict: its own local tensors (the blocks
    it publishes), their placements, and its shard `(index, count)` (None: it owns no block
    and publishes nothing)."""

    tensors: dict[str, torch.Tensor]
    placements: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]
    shard: tuple[int, int] | None


def has_dtensors(tensors: Mapping[str, object]) -> bool:
    """Whether any value is a DTensor (then `rank_shard` derives the publish)."""
    dtensor = _dtensor()
    return dtensor is not None and any(isinstance(t, dtensor) for t in tensors.values())


def chunk(size: int, parts: int, index: int) -> tuple[int, int]:
    """(length, start) of part `index` of `parts` of a dimension of `size`, as `torch.chunk`
    splits it (and DTensor's `Shard`): parts of ceil(size / parts), the last ones shorter
    or empty (an empty part starts at `size`)."""
    full = -(-size // parts)
    start = min(full * index, size)
    return max(0, min(size, full * index + full) - start), start


def block(
    global_shape: Sequence[int], mesh_shape: Sequence[int], coordinate: Sequence[int], order: Order
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(shape, offsets) of the block of a global tensor held at `coordinate` of a mesh:
    each tensor dimension of `order` split by its mesh dimensions in turn."""
    shape = [int(d) for d in global_shape]
    offsets = [0] * len(shape)
    for dim, mesh_dims in order:
        for mesh_dim in mesh_dims:
            length, start = chunk(shape[dim], int(mesh_shape[mesh_dim]), int(coordinate[mesh_dim]))
            shape[dim] = length
            offsets[dim] += start
    return tuple(shape), tuple(offsets)


@dataclass(frozen=True)
class _Spec:
    """What every rank knows of one tensor: its global shape, the ranks of its mesh (global
    ranks, in the mesh's shape), how it is split (`order`) and which mesh dims replicate it."""

    global_shape: tuple[int, ...]
    ranks: torch.Tensor  # the mesh: global ranks, shaped as the mesh
    order: tuple[tuple[int, tuple[int, ...]], ...]
    replicated: tuple[int, ...]  # mesh dims it is replicated over


def _spec(name: str, tensor: torch.Tensor, everyone: torch.Tensor) -> _Spec:
    """The `_Spec` of a DTensor (or of a plain tensor: whole, replicated over `everyone`)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(tensor, DTensor):
        return _Spec(tuple(tensor.shape), everyone, (), (0,))
    mesh = tensor.device_mesh
    split: dict[int, list[int]] = {}
    replicated: list[int] = []
    for mesh_dim, placement in enumerate(tensor.placements):
        if type(placement) is Shard:
            split.setdefault(int(placement.dim), []).append(mesh_dim)
        elif isinstance(placement, Replicate):
            replicated.append(mesh_dim)
        else:
            raise InvalidArgument(
                f"{name!r}: placement {placement} on mesh dimension {mesh_dim} cannot be "
                "published as one block per rank (Shard and Replicate can); redistribute it"
            )
    recorded = getattr(getattr(tensor, "_spec", None), "shard_order", None)
    if recorded:  # the order the DTensor applied its shardings in (newer torch records it)
        split = {int(e.tensor_dim): [int(m) for m in e.mesh_dims] for e in recorded}
    order = tuple(sorted((d, tuple(m)) for d, m in split.items()))
    return _Spec(tuple(tensor.shape), mesh.mesh, order, tuple(replicated))


def _owned(spec: _Spec, position: int) -> dict[int, tuple[tuple[int, ...], tuple[int, ...]]]:
    """The ranks that publish a block of the tensor at `position` among the names, and each
    one's (shape, offsets): per replica group, the member at `position` modulo the group's
    size; an empty block, nobody."""
    mesh_shape = tuple(spec.ranks.shape)
    group = math.prod(mesh_shape[d] for d in spec.replicated) if spec.replicated else 1
    pick = position % group
    out: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    for flat, rank in enumerate(spec.ranks.flatten().tolist()):
        coordinate = _unravel(flat, mesh_shape)
        member = 0
        for d in spec.replicated:  # this rank's index within its replica group
            member = member * mesh_shape[d] + coordinate[d]
        if member != pick:
            continue
        shape, offsets = block(spec.global_shape, mesh_shape, coordinate, spec.order)
        if math.prod(shape) > 0:
            out[int(rank)] = (shape, offsets)
    return out


def _unravel(flat: int, shape: Sequence[int]) -> tuple[int, ...]:
    coordinate = []
    for size in reversed(shape):
        coordinate.append(flat % size)
        flat //= size
    return tuple(reversed(coordinate))


def rank_shard(tensors: Mapping[str, torch.Tensor], rank: int | None = None) -> RankShard:
    """What rank `rank` (default: this process's global rank) publishes of a state dict
    with DTensors (module docstring): its local tensors, their placements, its shard."""
    from torch.distributed.tensor import DTensor

    if rank is None:
        if not dist.is_initialized():
            raise InvalidArgument("DTensors need torch.distributed initialized on this rank")
        rank = dist.get_rank()
    for name, value in tensors.items():
        if not isinstance(value, torch.Tensor):
            raise InvalidArgument(f"{name!r} is not a tensor")
    meshes = [t.device_mesh.mesh for t in tensors.values() if isinstance(t, DTensor)]
    everyone = torch.tensor(sorted({int(r) for m in meshes for r in m.flatten().tolist()}))
    names = sorted(tensors)
    mine: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    publishing: set[int] = set()
    for position, name in enumerate(names):
        spec = _spec(name, tensors[name], everyone)
        owners = _owned(spec, position)
        publishing.update(owners)
        if rank in owners:
            mine[name] = owners[rank]
    local: dict[str, torch.Tensor] = {}
    placements: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    for name, (shape, offsets) in mine.items():
        value = tensors[name]
        own = value.to_local() if isinstance(value, DTensor) else value
        if tuple(own.shape) != shape:
            raise InvalidArgument(
                f"{name!r}: rank {rank} holds a local tensor of shape {tuple(own.shape)}, "
                f"its placements say {shape}"
            )
        local[name] = own
        if isinstance(value, DTensor):
            placements[name] = (tuple(value.shape), offsets)
    if rank not in publishing:
        return RankShard({}, {}, None)
    ranks = sorted(publishing)
    return RankShard(local, placements, (ranks.index(rank), len(ranks)))


def for_publish(
    tensors: Mapping[str, torch.Tensor], shard: object, placements: Placements | None
) -> RankShard | None:
    """What this rank publishes of `tensors` if they hold DTensors (`rank_shard`); None if
    none is one (a plain publish). The DTensors say the shard and placements themselves:
    passing either too is refused."""
    if not has_dtensors(tensors):
        return None
    if shard is not None or placements:
        raise InvalidArgument(
            "a state dict of DTensors says its own shard and placements: pass neither"
        )
    return rank_shard(tensors)
