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
  rank's published tensors are written to `$TH_OUT` for the test to compare.

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
from tensorhub.errors import TensorHubError
from tests.gloo_ranks import leave, rank_session, say_and_serve


def tensors_of(rank: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s tensors: 2 of 1,000 float32 each, a function of the rank."""
    return {f"r{rank}.w{i}": torch.arange(1000.0) + 1000 * rank + i for i in range(2)}


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
            out_dir = Path(os.environ.get("TH_OUT") or ".")
            if args.mode == "fsdp":
                from tests.ros.dtensor_rank_proc import llama

                state, full = llama("fsdp", world)  # type: ignore[assignment]
                shard = None
                if rank == 0:
                    torch.save(
                        {k: v.detach().clone() for k, v in full.items()}, out_dir / "full.pt"
                    )
            else:
                state = dict(tensors_of(rank))
                if args.mode == "fail-one" and rank == 1:
                    state["bad"] = "not a tensor"
            out: dict[str, object] = {"rank": rank}
            try:
                publication = hub.publish(
                    args.model,
                    1,
                    state,
                    shard=shard,
                    group=dist.group.WORLD,  # type: ignore[arg-type]
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
