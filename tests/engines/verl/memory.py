"""Host memory of each verl actor rank per weight update, per-rank shards against the
gathered stream (issue 35, item 2):
`python -m tests.engines.verl.memory [--world 2] [--updates 8] [--modes gathered,shards]`.

Two actor ranks (tests/engines/verl/fsdp_rank_proc.py: real FSDP2 over gloo on CPU, verl's
own `update_weights` and FSDP engine code, the `tensorhub` backend, a real etcd and hub
started here) on a Llama of about 450 MB in fp32 (`SIZES["memory"]`), and two rollout
engines here that read each version as verl's rollout workers do (`receive_weights`);
eight updates by default (each after an RL-sized step, so the later ones are published
with their deltas), in a run of fresh processes per mode:

- `gathered` (`shards=False`): verl's generator is walked, every tensor all-gathered, and
  rank 0 copies the stream into host tensors and publishes the whole model, keeping a base
  copy for deltas;
- `shards` (the default): every rank publishes its own shard, staged to host, keeping a
  base copy of its shard; rollout r holds shard r (`ros.integrations.verl_read`).

Per rank and update: `peak` is the peak resident memory during the update over the resident
memory before it (`/proc/self/status` VmHWM, reset before the update through
`/proc/self/clear_refs`), `kept` the resident growth that stays after it; `served` and
`base` are what the rank's publication serves and what the SDK keeps as its delta base,
counted exactly, and `spills` the host copies the rank's SDK made to release a version the
hub still retained. Per rank over the whole run: `highest`, the peak resident memory of any
update over the resident memory before the first (the kept growth of the updates before it
plus its peak), and `end`, the growth kept after the last. The bound is the issue's: its
own shard, plus its delta base (its shard), plus 64 MiB. Prints the tables and the figures
as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from consistency import EtcdCluster, Keys
from ros.hub.server import HubServer
from ros.hub.tenants import TenantStore
from tests.engines.verl.ranks import ActorRanks

MiB = 1 << 20
SLACK = 64 * MiB


def receive(engines: list[Any], version: int) -> None:
    """The rollouts' side of one update, all at once (what they yield is dropped)."""
    for rank, engine in enumerate(engines):
        engine.init_process_group(role="rollout", rank=rank, version=version)

    async def read(engine: Any) -> None:
        async for _ in engine.receive_weights(global_steps=version):
            pass

    async def every() -> None:
        await asyncio.gather(*[read(engine) for engine in engines])

    asyncio.run(asyncio.wait_for(every(), 600))
    for engine in engines:
        engine.finalize()


def run(
    hub: HubServer, token: str, mode: str, world: int, updates: int
) -> list[list[dict[str, Any]]]:
    """`updates` updates in fresh rank processes, read by `world` rollouts; each update's
    answers, by rank."""
    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl.utils.import_utils import import_external_libs

    import_external_libs("ros.integrations.verl")
    model = f"mem-{mode}"
    kwargs = {"hub": hub.address, "tenant": "mem", "token": token, "model": model}
    rollouts = [
        CheckpointEngineRegistry.new("tensorhub", bucket_size=1 << 20, timeout=600, **kwargs)
        for _ in range(world)
    ]
    ranks = ActorRanks(hub.address, "mem", token, model, "memory", world, timeout=300)
    try:
        ranks.collect(300)
        out = []
        for step in range(1, updates + 1):
            ranks.all("step", 120, seed=step, check=False)
            out.append(ranks.all("update", 600, step=step, shards=mode == "shards", group=True))
            receive(rollouts, step)
        return out
    finally:
        ranks.close()
        for rollout in rollouts:
            rollout.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--updates", type=int, default=8)
    ap.add_argument("--modes", default="gathered,shards")
    args = ap.parse_args()
    figures: dict[str, Any] = {}
    with EtcdCluster(size=1) as etcd:
        keys = Keys("/verl-memory")
        hub = HubServer(etcd.endpoints, admin_token="admin", keys=keys).start()
        try:
            token = TenantStore(hub.etcd, hub.keys).create("mem")
            for mode in args.modes.split(","):
                figures[mode] = run(hub, token, mode, args.world, args.updates)
        finally:
            hub.stop(grace=0.2)
    print(f"{'mode':9} {'upd':>3} {'rank':>4} {'model':>7} {'shard':>7} {'served':>7} "
          f"{'base':>7} {'peak':>7} {'kept':>7} {'bound':>7} {'spills':>6}  (MiB)")  # fmt: skip
    for mode, updates in figures.items():
        for step, answers in enumerate(updates, start=1):
            for a in answers:
                bound = 2 * a["shard_bytes"] + SLACK
                print(f"{mode:9} {step:>3} {a['rank']:>4} {a['model_bytes'] / MiB:7.1f} "
                      f"{a['shard_bytes'] / MiB:7.1f} {a['served_bytes'] / MiB:7.1f} "
                      f"{a['base_bytes'] / MiB:7.1f} {a['peak_growth'] / MiB:7.1f} "
                      f"{a['rss_growth'] / MiB:7.1f} {bound / MiB:7.1f} "
                      f"{a['spills']:>6}")  # fmt: skip
    print(f"\n{'mode':9} {'rank':>4} {'highest':>8} {'end':>8} {'bound':>8}  (MiB, over the run)")
    for mode, updates in figures.items():
        for rank in range(args.world):
            kept, highest = 0, 0
            for answers in updates:
                a = answers[rank]
                highest = max(highest, kept + a["peak_growth"])
                kept += a["rss_growth"]
            bound = 2 * updates[0][rank]["shard_bytes"] + SLACK
            print(f"{mode:9} {rank:>4} {highest / MiB:8.1f} {kept / MiB:8.1f} "
                  f"{bound / MiB:8.1f}")  # fmt: skip
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
