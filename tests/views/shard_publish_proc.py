"""One trainer rank that publishes its shard of a model-parallel version with views, for
tests/views/test_shard_views_publish.py.

Run from the repository root, one process per rank, with torch.distributed's environment
(`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`), as
`python -m tests.views.shard_publish_proc HUB TENANT TOKEN MODEL MODE`. Every rank joins a
gloo process group, builds the same seeded weights (`whole`), keeps its own block of each
(`blocks`: uneven cuts, a 128x128 block split across ranks) and publishes them as MODEL@1
with both views, by MODE:

- `ranks`: each rank its own Publish (`shard=`, `placements=`);
- `group`: one call for the group (`group=` the default group);
- `dtensor`: the blocks as DTensors of a 1-D mesh (`Shard(0)`, `Shard(1)`, `Replicate`);
- `dies`: as `ranks`, but the last rank exits (status 3) after its views were made and
  before its Publish is sent: the others' shards land, the version never completes;
- `nan`: as `ranks`, with a NaN in the last rank's block of a weight cut on block edges;
- `delta`: as `ranks`, with `delta=True`, MODEL@1 and then MODEL@2 (`whole(2)`): each
  rank's view shards of version 2 are deltas against its view shards of version 1.

It prints one JSON line (its rank, and `visible` or the error's type and text), then
serves until its stdin closes.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.distributed as dist

import ros
from tensorhub.errors import TensorHubError
from tests.gloo_ranks import leave, rank_session, say_and_serve

FORMATS = ("fp8-block128", "mxfp8")

# name -> (global shape, dimension cut or None: whole on the last rank only)
WEIGHTS: dict[str, tuple[tuple[int, ...], int | None]] = {
    "model.layers.0.self_attn.o_proj.weight": ((128, 128), 0),  # one block, split
    "model.layers.0.self_attn.q_proj.weight": ((300, 260), 0),
    "model.layers.0.self_attn.k_proj.weight": ((256, 128), 0),  # 2 ranks: cut on a block edge
    "model.layers.0.mlp.down_proj.weight": ((200, 300), 1),
    "model.layers.0.mlp.up_proj.weight": ((160, 100), 0),  # mxfp8 leaves it (100 % 32)
    "model.layers.0.mlp.gate_proj.weight": ((96, 128), None),  # whole, one rank's
    "lm_head.weight": ((256, 128), 0),  # never quantized, still split
    "model.norm.weight": ((128,), None),
}
CUTS = {2: (0.5,), 4: (0.2, 0.45, 0.8)}  # where each rank's part starts, as fractions


def whole(version: int = 1) -> dict[str, torch.Tensor]:
    """The version's whole tensors (bf16, seeded), with blocks of small and large
    magnitude, so that a split block's pieces have different amaxes; version 2 is
    version 1 after a small step."""
    if version == 2:
        g = torch.Generator().manual_seed(2)
        return {name: (w.float() + torch.randn(w.shape, generator=g) * 1e-3).to(torch.bfloat16)
                for name, w in whole(1).items()}  # fmt: skip
    g = torch.Generator().manual_seed(36)
    out: dict[str, torch.Tensor] = {}
    for name, (shape, _) in WEIGHTS.items():
        w = torch.randn(*shape, generator=g) * 0.02
        if len(shape) == 2:
            w[: shape[0] // 3] *= 1e-3
            w[:, : shape[1] // 5] *= 50.0
        out[name] = w.to(torch.bfloat16)
    return out


def bounds(size: int, world: int, rank: int) -> tuple[int, int]:
    """[start, stop) of rank `rank`'s part of a dimension of `size`."""
    starts = [0, *(round(size * f) for f in CUTS[world]), size]
    return starts[rank], starts[rank + 1]


def blocks(
    rank: int, world: int, version: int = 1
) -> tuple[dict[str, torch.Tensor], dict[str, tuple[list[int], list[int]]]]:
    """Rank `rank`'s tensors of `version` and their placements."""
    tensors: dict[str, torch.Tensor] = {}
    placements: dict[str, tuple[list[int], list[int]]] = {}
    for name, w in whole(version).items():
        shape, dim = WEIGHTS[name]
        if dim is None:
            if rank == world - 1:
                tensors[name] = w
            continue
        start, stop = bounds(shape[dim], world, rank)
        tensors[name] = w.narrow(dim, start, stop - start).contiguous()
        offsets = [0] * len(shape)
        offsets[dim] = start
        placements[name] = (list(shape), offsets)
    return tensors, placements


def dtensors(rank: int, world: int) -> dict[str, torch.Tensor]:
    """The whole tensors as DTensors of a 1-D mesh: split ones `Shard(dim)` (torch.chunk's
    cut, not `CUTS`), whole ones `Replicate`."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    return {
        name: distribute_tensor(w, mesh, [Replicate() if WEIGHTS[name][1] is None
                                          else Shard(WEIGHTS[name][1] or 0)])
        for name, w in whole().items()
    }  # fmt: skip


def main() -> int:
    hub_address, tenant, token, model, mode = sys.argv[1:6]
    with rank_session() as (rank, world):
        said: dict[str, Any] = {"rank": rank}
        hub = ros.connect(hub_address, tenant=tenant, token=token)
        try:
            if mode == "dtensor":
                kwargs: dict[str, Any] = {}
                state = dtensors(rank, world)
            else:
                state, placements = blocks(rank, world)
                kwargs = {"shard": (rank, world), "placements": placements}
                if mode == "group":
                    kwargs = {**kwargs, "group": dist.group.WORLD}
                if mode == "nan" and rank == world - 1:
                    # in a block cut on block edges: its holder alone would quantize it
                    state["model.layers.0.self_attn.k_proj.weight"][5, 7] = float("nan")
                if mode == "dies" and rank == world - 1:
                    from ros.client.publishing import Publisher

                    def die(*_: object, **__: object) -> None:
                        sys.stdout.flush()
                        os._exit(3)  # the views were made (and agreed); nothing was sent

                    Publisher._publish = die  # type: ignore[assignment,method-assign]
            try:
                if mode == "delta":
                    kwargs["delta"] = True
                    hub.publish(model, 1, state, views=FORMATS, timeout=30, **kwargs)
                    state = blocks(rank, world, 2)[0]
                publication = hub.publish(
                    model, 2 if mode == "delta" else 1, state, views=FORMATS, timeout=30, **kwargs
                )
                said["visible"] = publication.visible
                said["companions"] = {
                    fmt: view.companion is not None for fmt, view in publication.views.items()
                }
                said["shard"] = publication.shard
            except TensorHubError as exc:
                said["error"] = type(exc).__name__
                said["message"] = str(exc)
            say_and_serve(said)
        finally:
            hub.close()
    return 0


if __name__ == "__main__":
    leave(main())
