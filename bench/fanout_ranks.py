"""`tensorhub bench fanout`'s trainer with several ranks: its stall per step, published
through the group path and through one call per rank, in the same run.

`RANKS` rank processes on the trainer's emulated host (`python -m bench.fanout_ranks IP`,
inside its namespace; one JSON command a line on stdin, one answer a line on stdout, as a
participant) each connect their own SDK client (their own session and holder endpoint) and
join one gloo group. Per step, each rank publishes its shard of the model (`nbytes / RANKS`
of float32, `shard=(rank, RANKS)`) of one version, twice, each into its own model:

- `group`: `publish(..., group=WORLD)`: the ranks gather their requests over the group and
  the first sends them in one PublishShards call;
- `per_rank`: `publish(...)` on every rank at once: one Publish call each.

The stall of a step is what the trainer waits before its next step: from the ranks' common
start (a barrier just before the publish) until the last rank's publish has returned (the
version visible). The shards are made before the barrier, and each is released (`force`:
no reader holds it) before the next step. The two modes alternate which goes first from
step to step, so neither always runs on a hub the other has just warmed.
"""

from __future__ import annotations

import os
import queue
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from bench.common import Options
from bench.emu import commands
from bench.emu.control import Participant, broadcast, gather
from bench.emu.netns import Emulation, Host

RANKS = 8
STEPS = 16
MODES = ("group", "per_rank")
MASTER_PORT = 29600


class RankProcess(Participant):
    """`python -m bench.fanout_ranks` inside `host`'s namespace: a participant's protocol
    and handle (`send`, `reply`, `kill`), another program."""

    def __init__(
        self, emu: Emulation, host: Host, rank: int, log: Path, env: dict[str, str]
    ) -> None:
        self.host, self.role, self.log = host, f"trainer rank {rank}", log
        argv = emu.exec_argv(host, [sys.executable, "-m", "bench.fanout_ranks", host.ip])
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **env}
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
            start_new_session=True, stderr=log.open("ab"),
        )  # fmt: skip
        self._replies: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()


def measure(
    cluster: Any,
    opts: Options,
    ranks: int = RANKS,
    steps: int = STEPS,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """The stall per step of `ranks` trainer ranks on the cluster's first host, in each mode
    (module docstring): seconds per step, by mode, and their medians."""
    done = progress or (lambda what: None)
    host = cluster.emu.hosts[0]
    procs = [
        RankProcess(cluster.emu, host, rank, cluster.logs / f"rank-{rank}.log", cluster.env)
        for rank in range(ranks)
    ]
    try:
        gather(procs, 120)  # each says {"ready": true} once imported
        for rank, p in enumerate(procs):
            p.send("init", hub=[cluster.hub_address(host.dc, 0)], tenant="bench",
                   token=cluster.token, topology=host.topology, master=host.ip,
                   port=MASTER_PORT, rank=rank, world=ranks)  # fmt: skip
        gather(procs, 120)
        stalls: dict[str, list[float]] = {mode: [] for mode in MODES}
        for step in range(1, steps + 1):
            order = MODES if step % 2 else tuple(reversed(MODES))
            for mode in order:
                got = broadcast(procs, "publish", 120, model=f"ranks-{mode}", version=step,
                                nbytes=opts.nbytes // ranks, seed=opts.seed,
                                chunk=opts.chunk, group=mode == "group")  # fmt: skip
                stalls[mode].append(max(g["t1"] for g in got) - min(g["t0"] for g in got))
                if procs[0].call("latest", 60, model=f"ranks-{mode}")["latest"] < step:
                    raise RuntimeError(f"{mode} step {step}: every rank returned, not visible")
                broadcast(procs, "release", 60, model=f"ranks-{mode}", version=step)
        for mode in MODES:
            done(f"trainer ranks {mode}: median stall {statistics.median(stalls[mode]):.3f}s")
        return {
            "ranks": ranks,
            "shard_bytes": opts.nbytes // ranks,
            "stall_s": {mode: [round(s, 4) for s in stalls[mode]] for mode in MODES},
            "median_s": {mode: round(statistics.median(stalls[mode]), 4) for mode in MODES},
        }
    finally:
        for p in procs:
            if p.proc.stdin is not None and not p.proc.stdin.closed:
                p.proc.stdin.close()
        for p in procs:
            try:
                p.proc.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()


# -- the rank process ----------------------------------------------------------------------


class Rank:
    """One trainer rank: its client, its gloo group, its publications."""

    def __init__(self, ip: str) -> None:
        self.ip = ip
        self.hub: Any = None
        self.rank = 0
        self.pubs: dict[tuple[str, int], Any] = {}

    def init(
        self,
        hub: list[str],
        tenant: str,
        token: str,
        topology: dict[str, str],
        master: str,
        port: int,
        rank: int,
        world: int,
    ) -> Any:
        import torch.distributed as dist

        import ros

        self.hub = ros.connect(
            hub, tenant=tenant, token=token, topology=topology, listen=f"{self.ip}:0"
        )
        dist.init_process_group(
            "gloo", init_method=f"tcp://{master}:{port}", rank=rank, world_size=world,
            timeout=timedelta(seconds=120),
        )  # fmt: skip
        self.rank = rank
        return {"rank": rank}

    def publish(
        self, model: str, version: int, nbytes: int, seed: int, chunk: int, group: bool
    ) -> Any:
        import torch.distributed as dist

        from bench.emu.model import make_model

        tensors = make_model(nbytes, seed + self.rank)
        world = dist.get_world_size()
        dist.barrier()
        t0 = time.monotonic()
        pub = self.hub.publish(
            model, version, tensors, chunk_size=chunk, shard=(self.rank, world),
            group=dist.group.WORLD if group else None,
        )  # fmt: skip
        t1 = time.monotonic()
        self.pubs[(model, version)] = pub
        return {"t0": t0, "t1": t1}

    def latest(self, model: str) -> Any:
        return {"latest": self.hub.latest(model)}

    def release(self, model: str, version: int) -> Any:
        pub = self.pubs.pop((model, version), None)
        if pub is not None:
            pub.release(force=True)
        return {}


def main() -> int:
    me = Rank(sys.argv[1])
    ops: dict[str, Callable[..., Any]] = {"init": me.init, "publish": me.publish,
                                          "latest": me.latest, "release": me.release}  # fmt: skip
    commands.serve(ops)
    if me.hub is not None:
        me.hub.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
