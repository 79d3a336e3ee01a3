"""One rank of a process group that publishes its shard with `publish(..., group=...)`, for
tests/ros/test_group_publish.py.

Run from the repository root, one process per rank, with torch.distributed's environment
(`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`), as
`python -m tests.ros.group_rank_proc HUB TENANT TOKEN MODEL MODE`. Every rank joins a gloo
process group (CPU) and publishes MODEL@1 through the group, by MODE:

- `plain`: its own tensors (a function of its rank), `shard=(rank, world)`;
- `fail-one`: the same, but rank 1 passes something that is not a tensor, so its publish
  fails before it has a request to send (the others must not be left waiting);
- `fsdp`: the tiny Llama of tests/ros/dtensor_rank_proc.py under FSDP2, its DTensor state
  dict as it is (the shards and placements derived); the full state dict (rank 0) and each
  rank's published tensors are written to `$TH_OUT` for the test to compare;
- `layout`: its TP-2 shard of the model of tests/ros/layout_model.py, MODEL@2 (the test
  published MODEL@1 and declared a layout of it): with its parts of the publisher's
  checksums (tests/ros/test_publisher_parts.py);
- `skewed`: the same, but rank 0 reads the declarations first and rank 1 then declares
  layout `tp1` again (its whole tensors), so that the ranks' parts name two revisions.

It prints one JSON line (rank, shard, visible, the error's class name if its publish
failed), then serves until its stdin closes.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist

import ros
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from tensorhub.errors import TensorHubError
from tests.gloo_ranks import leave, rank_session, say_and_serve
from tests.ros.layout_model import CHUNK, block, expected, global_model


def tensors_of(rank: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s tensors: 2 of 1,000 float32 each, a function of the rank."""
    return {f"r{rank}.w{i}": torch.arange(1000.0) + 1000 * rank + i for i in range(2)}


def tp_shard(
    rank: int, world: int
) -> tuple[dict[str, object], dict[str, tuple[tuple[int, ...], tuple[int, ...]]]]:
    """Rank `rank`'s TP-`world` shard of tests/ros/layout_model.py's model, and its
    placements (the split tensors'; the others are replicated)."""
    tensors: dict[str, object] = {}
    placements = {}
    for name, tensor in global_model().items():
        offsets, _ = block(name, rank, world)
        tensors[name] = expected(rank, world)[name].contiguous()
        if name.endswith(("qkv.weight", "o.weight")):
            placements[name] = (tuple(tensor.shape), offsets)
    return tensors, placements


def whole_slices() -> dict[str, ros.Slice]:
    """Layout `tp1` of the model: each tensor whole."""
    return {
        name: ros.Slice(torch.empty_like(t), (0,) * t.dim(), tuple(t.shape))
        for name, t in global_model().items()
    }


def skew(hub: ros.Hub, model: str, rank: int) -> None:
    """Rank 0 reads the model's declarations (its publish then names that revision, read
    under `DECLARED_TTL` ago); then rank 1 declares `tp1` again, a later revision, which its
    own publish reads."""
    if rank == 0:
        request = pb.DeclaredLayoutsRequest(model=model)
        hub._publisher._declared.put(model, hub._rpc("DeclaredLayouts", request))
    dist.barrier()
    if rank == 1:
        hub.declare_layout(model, "tp1", [whole_slices()])
    dist.barrier()


def main() -> int:
    ap = argparse.ArgumentParser()
    for name in ("hub", "tenant", "token", "model", "mode"):
        ap.add_argument(name)
    args = ap.parse_args()
    with rank_session() as (rank, world):
        hub = ros.connect(args.hub, tenant=args.tenant, token=args.token)
        try:
            shard: tuple[int, int] | None = (rank, world)
            state: dict[str, object]
            placements: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] | None = None
            out_dir = Path(os.environ.get("TH_OUT") or ".")
            if args.mode == "fsdp":
                from tests.ros.dtensor_rank_proc import llama

                state, full = llama("fsdp", world)  # type: ignore[assignment]
                shard = None
                if rank == 0:
                    torch.save(
                        {k: v.detach().clone() for k, v in full.items()}, out_dir / "full.pt"
                    )
            elif args.mode in ("layout", "skewed"):
                state, placements = tp_shard(rank, world)
                if args.mode == "skewed":
                    skew(hub, args.model, rank)
            else:
                state = dict(tensors_of(rank))
                if args.mode == "fail-one" and rank == 1:
                    state["bad"] = "not a tensor"
            out: dict[str, object] = {"rank": rank}
            try:
                layout = args.mode in ("layout", "skewed")
                publication = hub.publish(
                    args.model,
                    2 if layout else 1,
                    state,
                    shard=shard,
                    group=dist.group.WORLD,  # type: ignore[arg-type]
                    placements=placements,
                    chunk_size=CHUNK if layout else None,
                )
                out.update(shard=publication.shard, visible=publication.visible)
                if args.mode == "fsdp" and publication.shard is not None:
                    copies = {k: v.clone() for k, v in publication.tensors.items()}
                    torch.save(copies, out_dir / f"shard-{publication.shard}.pt")
            except TensorHubError as exc:
                out.update(error=type(exc).__name__, message=str(exc))
            say_and_serve(out)
        finally:
            hub.close()
    return 0


if __name__ == "__main__":
    leave(main())
