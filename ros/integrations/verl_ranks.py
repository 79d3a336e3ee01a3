"""One verl actor rank's publish of its own shard of the FSDP state, and what it costs.

Every actor rank runs this in the same update, with the DTensor state dict of verl's FSDP2
engine (`ros.integrations.verl_shards`). `ros.client.dtensors.rank_shard` derives, from
metadata every rank has, the blocks this rank publishes (its local shards; a replicated
tensor by one rank of its replica group) and its shard `(index, count)` of the version.
The blocks are copied into host tensors this rank owns (`stage`: reused from the version
before where name, shape and dtype match), because the DTensors are the live parameters:
the next optimizer step changes them in place, and verl may move them between host and
device, while the version must stay what was published for as long as it is served. So a
rank holds its own shard once more, never the model: nothing is gathered, to rank 0 or
anywhere. With `delta`, the SDK keeps one more copy of the shard as the next version's base
(per shard: each rank encodes its own shard's changes).

`group` (a `torch.distributed` process group, verl's actor ranks): the ranks' shards reach
the hub in one `PublishShards` call per version (`publish(..., group=)`); None, one Publish
per rank. Either way each rank serves its own shard from its own endpoint, and the version
is visible with the last shard.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ros.client.dtensors import rank_shard
from ros.client.handles import Publication
from ros.client.hub import Hub
from tensorhub.errors import InvalidArgument

ProcessGroup = Any  # a torch.distributed ProcessGroup (its stubs are not typed)


@dataclass
class RankPublish:
    """What one rank's publish did: its publication (None: it owns no block), the version,
    its shard `(index, count)`, and the bytes it staged (its shard) and keeps as delta base."""

    publication: Publication | None
    version: int
    shard: tuple[int, int] | None
    staged_bytes: int
    base_bytes: int


def stage(
    tensors: Mapping[str, torch.Tensor], reuse: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Contiguous host copies of `tensors`, written into `reuse`'s where name, shape and
    dtype match (the previous version's memory), new ones elsewhere."""
    with torch.no_grad():
        return {name: host_copy(tensor, reuse.get(name)) for name, tensor in tensors.items()}


def host_copy(tensor: torch.Tensor, reuse: torch.Tensor | None) -> torch.Tensor:
    """A contiguous host copy of `tensor`, written into `reuse` where its shape and dtype
    match (the previous version's memory of that name), a new tensor elsewhere. Call it
    under `torch.no_grad()`."""
    source = tensor.detach()
    target = reuse
    if target is None or target.shape != source.shape or target.dtype != source.dtype:
        target = torch.empty(source.shape, dtype=source.dtype, device="cpu")
    target.copy_(source)
    return target


def agree_on_version(hub: Hub, model: str, group: ProcessGroup, timeout: float) -> int:
    """`latest() + 1` as the group's first rank sees it, on every rank (an update driven
    without verl's topology, which otherwise hands every rank the version)."""
    found: list[int | None] = [None]
    if dist.get_rank(group) == 0:
        found[0] = hub.latest(model, timeout=timeout) + 1
    dist.broadcast_object_list(found, src=dist.get_global_rank(group, 0), group=group)
    if found[0] is None:
        raise InvalidArgument("tensorhub checkpoint engine: no version from the first rank")
    return int(found[0])


def publish_shard(
    hub: Hub,
    model: str,
    version: int | None,
    state: Mapping[str, torch.Tensor],
    reuse: Mapping[str, torch.Tensor],
    *,
    group: ProcessGroup | None,
    delta: bool,
    base_copy: str,
    deadline: float,
) -> RankPublish:
    """Publish this rank's blocks of `state` (DTensors) as its shard of `model@version`
    (module docstring), staged into `reuse`'s memory where it fits. Every rank of `group`
    must call this for the same version."""
    derived = rank_shard(state)
    everyone = group if group is not None else dist.group.WORLD
    if version is None:
        version = agree_on_version(hub, model, everyone, _left(deadline))
    if derived.shard is None:  # a replica that owns no block: no shard of the version
        if group is not None:  # the DTensors say so to the SDK too: it joins, sends nothing
            hub.publish(model, version, state, group=group, timeout=_left(deadline))
        return RankPublish(None, version, None, 0, 0)
    try:
        staged = stage(derived.tensors, reuse)
    except BaseException:
        if group is not None:
            _join_empty(hub, model, version, state, group)
        raise
    publication = hub.publish(
        model, version, staged, shard=derived.shard, placements=derived.placements,
        group=group, timeout=_left(deadline), delta=delta, base_copy=base_copy,
    )  # fmt: skip
    nbytes = sum(t.nbytes for t in staged.values())
    return RankPublish(
        publication, version, derived.shard, nbytes, hub.delta_memory()["base_copies"]
    )


def _join_empty(
    hub: Hub, model: str, version: int, state: Mapping[str, torch.Tensor], group: ProcessGroup
) -> None:
    """Take part in the group's exchange with nothing, so the other ranks are not left
    waiting in its gather: a publish the SDK refuses before it has a request still joins
    (`ros.client.group_publish`), and a DTensor state dict with an explicit shard is one."""
    with contextlib.suppress(InvalidArgument):
        hub.publish(model, version, state, shard=(0, 1), group=group)


def _left(deadline: float) -> float:
    """Seconds to the deadline, at least a tenth: a rank that ran out still takes part in
    its group's exchange, and its publish then fails there with `DeadlineExceeded`."""
    return max(deadline - time.monotonic(), 0.1)
