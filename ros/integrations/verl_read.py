"""A verl rollout's read of a version of shards (one per actor rank) into whole tensors.

A rollout engine loads whole tensors. Each global tensor is allocated once (or reused from
the version before, where name, shape and dtype match) and filled from the shards that hold
its blocks:

- where every block of every shard is a run of whole rows of its tensor (FSDP2's
  `Shard(0)`, and tensors published whole), rollout `r` fetches shard `r mod N` as its
  holder (`fetch(shard=)`: one shard per client), straight into the rows of the whole
  tensors it holds, and serves it to the other rollouts from then on; the other shards'
  rows it reads with `fetch_slices`, one call per shard, from whoever holds them. With as
  many rollouts as shards, every shard of a version has a holder besides its actor rank, so
  the rank's release of that version (its memory reused for the next) needs no spill while
  the hub still retains it. Into the memory of the version before, the held shard's delta
  moves only its changes (`base`);
- any other layout (a block that is no run of rows: tensor parallelism's `Shard(1)`) is
  read with one `fetch_slices` of every global tensor whole, holding nothing.

`fetch_slices(delta=True)` keeps a staging copy of each source shard it reads as the base
of the next read (the SDK's; `Hub.drop_bases` frees them).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from ros.client.handles import Held
from ros.client.hub import Hub
from ros.client.manifest import placement_of
from ros.client.slice import Slice
from ros.client.slice_fetch import SliceFetch
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from tensorhub.errors import DeadlineExceeded
from transport.layout import torch_dtype

Rows = dict[str, tuple[int, int] | None]  # name -> (first row, rows) of its tensor; None: whole


@dataclass
class ShardsRead:
    """The whole tensors read, and how: the shard held (`held`: at most one), and the
    `fetch_slices` answers of the rest (`sliced`)."""

    tensors: dict[str, torch.Tensor]
    held: list[Held] = field(default_factory=list)
    sliced: list[SliceFetch] = field(default_factory=list)


def whole_tensors(
    resolved: pb.ResolveResponse, reuse: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """One host tensor per global tensor of the version's shards: `reuse`'s where name,
    shape and dtype match, new ones elsewhere."""
    wanted: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for manifest in resolved.shards:
        for entry in manifest.tensors:
            glob, _ = placement_of(entry)
            wanted[entry.name] = (glob, torch_dtype(entry.dtype))
    tensors: dict[str, torch.Tensor] = {}
    for name, (shape, dtype) in wanted.items():
        target = reuse.get(name)
        if target is None or tuple(target.shape) != shape or target.dtype != dtype:
            target = torch.empty(shape, dtype=dtype)
        tensors[name] = target
    return tensors


def rows_of(resolved: pb.ResolveResponse) -> list[Rows] | None:
    """Per shard, the rows of each tensor it holds; None if a block is no run of rows."""
    out: list[Rows] = []
    for manifest in resolved.shards:
        rows: Rows = {}
        for entry in manifest.tensors:
            glob, box = placement_of(entry)
            if tuple(box.shape) == glob:
                rows[entry.name] = None
            elif len(glob) and box.shape[1:] == glob[1:] and not any(box.offsets[1:]):
                rows[entry.name] = (int(box.offsets[0]), int(box.shape[0]))
            else:
                return None
        out.append(rows)
    return out


def read_shards(
    hub: Hub,
    model: str,
    version: int,
    resolved: pb.ResolveResponse,
    reuse: Mapping[str, torch.Tensor],
    *,
    rank: int,
    base: int | None,
    delta: bool,
    deadline: float,
) -> ShardsRead:
    """Read `model@version`, a version of shards, into whole tensors (module docstring),
    as rollout `rank`; `base`: the version `reuse`'s memory holds (the held shard's delta
    base)."""
    tensors = whole_tensors(resolved, reuse)
    rows = rows_of(resolved)
    if rows is None:
        slices = {n: Slice(t, [0] * t.dim(), list(t.shape)) for n, t in tensors.items()}
        answer = hub.fetch_slices(
            model, version, slices=slices, timeout=_left(deadline, model, version), delta=delta
        )
        return ShardsRead(tensors, sliced=[answer])
    read = ShardsRead(tensors)
    mine = rank % len(rows)
    try:
        # the shard it holds last: the SDK finds a delta's encoded chunks this client holds
        # by version, whichever shard they are of, so once it held its own shard's, the
        # slices of the others would be refused their deltas (and read whole)
        for index, held_rows in enumerate(rows):
            if index == mine:
                continue
            slices = {
                name: Slice(view, [0 if at is None else at[0]] + [0] * (view.dim() - 1),
                            list(tensors[name].shape))
                for (name, view), at in zip(
                    _views(tensors, held_rows).items(), held_rows.values(), strict=True
                )
            }  # fmt: skip
            read.sliced.append(hub.fetch_slices(
                model, version, slices=slices, timeout=_left(deadline, model, version),
                delta=delta,
            ))  # fmt: skip
        reused = all(tensors[name] is reuse.get(name) for name in rows[mine])
        read.held.append(hub.fetch(
            model, version, shard=mine, into=_views(tensors, rows[mine]),
            timeout=_left(deadline, model, version), delta=delta,
            base=base if reused else None,
        ))  # fmt: skip
    except BaseException:
        for held in read.held:  # a partial read holds nothing: the caller gets the error
            held.release(force=True)
        raise
    return read


def _views(tensors: Mapping[str, torch.Tensor], rows: Rows) -> dict[str, torch.Tensor]:
    """The rows `rows` names of each whole tensor (a view: contiguous, the same memory)."""
    return {
        name: tensors[name] if at is None else tensors[name].narrow(0, at[0], at[1])
        for name, at in rows.items()
    }


def _left(deadline: float, model: str, version: int) -> float:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise DeadlineExceeded(f"{model}@{version}: no time left to fetch")
    return remaining
