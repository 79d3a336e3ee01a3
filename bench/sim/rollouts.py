"""Rollouts in another layout than the trainer's, with whole versions and with delta
versions, on the flow-level simulator (`bench.sim.engine`).

The cluster (`RolloutParams`, every field a flag of `tensorhub bench sim rollouts`): a
trainer of `trainer_gpus` GPUs holds the model sharded over them; `rollout_gpus` GPUs run
instances at TP `tp`, so each rollout GPU needs one block set, 1/`tp` of the model, and
there are `rollout_gpus / tp` readers of each block set. Every GPU has its own NIC of
`nic_gbps`; the fabric is non-blocking.

What is simulated is one block set (TP rank) and its readers: the `tp` block sets are
symmetric, so each trainer GPU gives each of them 1/`tp` of its uplink, and the trainer as
a whole serves one block set at `trainer_gpus * nic / tp` (a reshard: every block set is
cut from every trainer shard). The readers of a block set take their sources as the real
planner picks them (`transport.planner.pipeline_plan`, via `scenarios.tensorhub_fetch`):
the first from the trainer, each later one pipelined behind an earlier reader, a chunk
behind. The old path, every reader from the trainer's shards, is simulated beside it.

A delta version moves `delta_fraction` of the block set's bytes (the encoded changes;
`bench delta` measures 0.013-0.02 at lr 1e-6 on this project's model), after the
publisher's encode (`encode_gbps` over its shard's bytes). A reader's delta fetch is a
fixed cost (`delta_overhead_s`: the plan, the companion's resolve, the base's sample) plus
the longer of the companion's bytes on the links and its apply (`apply_gbps` over its
block set's bytes), which overlap: each encoded chunk is applied as it lands.

Calibration (`calibrate_delta`, `calibrate_reshard`): the same model run on the emulated
configuration of a `bench delta` or `bench reshard` JSON (its link rate, model, readers,
chunk; the codec's times as measured), against the times that run measured; within
`CALIBRATION` (15 %) is OK.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from bench.sim.engine import Flow, Network
from bench.sim.scenarios import Cluster, Params, tensorhub_fetch
from tensorhub.errors import InvalidArgument

GB = 1e9
CALIBRATION = 0.15  # |simulated / measured - 1| at most this on an emulated configuration
PAYLOAD = 1448 / 1514  # TCP payload per Ethernet frame: what a shaped link delivers


@dataclass(frozen=True)
class RolloutParams:
    """The paper-scale defaults: a 1T-parameter bf16 model, 256 trainer GPUs, 1,024 rollout
    GPUs at TP 8, 400 Gbit/s per GPU."""

    model_gb: float = 2000.0  # 1T parameters in bf16
    trainer_gpus: int = 256
    rollout_gpus: int = 1024
    tp: int = 8
    nic_gbps: float = 400.0  # per GPU
    chunk_mb: float = 4.0
    delta_fraction: float = 0.02  # encoded delta bytes / model bytes (about 1 % of words)
    # the codec's rates on a GPU, over the bytes of the shard or blocks (GB/s): assumed, a
    # pass or two over HBM; never measured (no GPU ran it). `calibrate` uses the CPU's.
    encode_gbps: float = 500.0  # the publisher's encode
    apply_gbps: float = 500.0  # a reader's apply and its check of the result
    # a delta fetch's fixed cost (plan, the companion's resolve, the base's sample): as
    # `calibrate` fitted it on this machine's `bench delta` (0.16 s at 200 Mbit/s, loaded)
    delta_overhead_s: float = 0.16

    @property
    def instances(self) -> int:
        return max(1, self.rollout_gpus // self.tp)

    @property
    def block_bytes(self) -> float:
        return self.model_gb * GB / self.tp

    @property
    def nic(self) -> float:
        return self.nic_gbps * GB / 8


def _cluster(p: RolloutParams, nbytes: float) -> Cluster:
    """One trainer endpoint, whose uplink is the trainer's share of its GPUs' uplinks for
    one block set, and one endpoint per instance (its GPU of this TP rank); each reads
    `nbytes`."""
    sim = Params(gpus=1 + p.instances, gpus_per_host=1, nic_gbps=p.nic * 8 / GB,
                 model_gb=nbytes / GB, chunk_mb=p.chunk_mb)  # fmt: skip
    c = Cluster(sim, {1: 1 + p.instances})
    c.net.capacity[c.up[0]] = p.trainer_gpus * p.nic / p.tp
    return c


def transfer(p: RolloutParams, nbytes: float, pipelined: bool) -> dict[str, float]:
    """Every instance's GPU of one TP rank reads `nbytes` of its block set: pipelined from
    each other (ROS across layouts) or each from the trainer. Returns the last reader's
    finish, and the trainer's bytes out over `nbytes` (per block set)."""
    c = _cluster(p, nbytes)
    readers = list(range(1, 1 + p.instances))
    if pipelined:
        tensorhub_fetch(c, readers, [0], 1)
    else:
        for r in readers:
            c.net.add(Flow(c.path(0, r), nbytes))
    end = c.net.run()
    return {"last_s": end, "trainer_out_per_model": c.net.bytes_on.get(c.up[0], 0.0) / nbytes}


def rollouts(p: RolloutParams) -> dict[str, Any]:
    """The rollout stall per step (publish to the last rollout GPU holding its verified
    blocks), whole versions and deltas, through ROS across layouts and from the trainer."""
    whole = transfer(p, p.block_bytes, pipelined=True)
    pull = transfer(p, p.block_bytes, pipelined=False)
    delta_bytes = p.block_bytes * p.delta_fraction
    encode = p.model_gb / p.trainer_gpus / p.encode_gbps
    apply = p.block_bytes / GB / p.apply_gbps
    dwire = transfer(p, delta_bytes, pipelined=True)
    dpull = transfer(p, delta_bytes, pipelined=False)
    return {
        "stall_s": {
            "whole": whole["last_s"],
            "whole_from_trainer": pull["last_s"],
            "delta": encode + p.delta_overhead_s + max(dwire["last_s"], apply),
            "delta_from_trainer": encode + p.delta_overhead_s + max(dpull["last_s"], apply),
        },
        "delta_parts_s": {
            "encode": encode,
            "fixed": p.delta_overhead_s,
            "wire": dwire["last_s"],
            "apply": apply,
        },
        "trainer_out_per_block_set": {
            "ros": whole["trainer_out_per_model"],
            "from_trainer": pull["trainer_out_per_model"],
        },
        "one_transfer_s": p.block_bytes / p.nic,
    }


@dataclass(frozen=True)
class Check:
    """One calibration: the simulated and the measured time of one configuration."""

    name: str
    simulated_s: float
    measured_s: float
    fitted: bool = False  # the point a parameter was fitted on: not a check

    @property
    def error(self) -> float:
        return self.simulated_s / self.measured_s - 1.0

    @property
    def ok(self) -> bool:
        return self.fitted or abs(self.error) <= CALIBRATION

    def to_dict(self) -> dict[str, Any]:
        return {"simulated_s": round(self.simulated_s, 4), "measured_s": round(self.measured_s, 4),
                "error": round(self.error, 4), "ok": self.ok, "fitted": self.fitted}  # fmt: skip


def _emulated(rate_mbit: float, readers: int, nbytes: float, chunk: float) -> RolloutParams:
    """One trainer host and `readers` reader hosts on shaped links of `rate_mbit`: one
    block set (tp 1) whose trainer has one link."""
    gbps = rate_mbit * 1e6 * PAYLOAD / 1e9
    return RolloutParams(model_gb=nbytes / GB, trainer_gpus=1, rollout_gpus=readers, tp=1,
                         nic_gbps=gbps, chunk_mb=chunk / 1e6)  # fmt: skip


def calibrate_delta(doc: Mapping[str, Any]) -> list[Check]:
    """`bench delta --json`'s run against the sim's model of a reader's delta fetch: a
    fixed cost (the plan, the companion's resolve, the base's sample) plus the longer of
    the companion's bytes on the links (simulated, the readers chained) and the apply (as
    measured: the codec applies each chunk as its encoded bytes land). The fixed cost is
    the one parameter fitted, on the first learning rate; the others and the whole fetch
    are the checks. Measured: the slowest reader's fetch, median over the steps."""
    d = doc.get("details", doc)
    readers = int(d["readers"])
    nbytes = float(d["model"]["bf16_bytes"])
    p = _emulated(float(d["rate_mbit"]), readers, nbytes, float(d["chunk_bytes"]))
    out: list[Check] = []
    overhead: float | None = None
    for name, run in d["runs"].items():
        steps = run["steps"]
        encoded = statistics.median(st["encoded_bytes"] / max(1, st["used_delta"]) for st in steps)
        wire = transfer(p, max(encoded, 1.0), pipelined=True)["last_s"]
        apply = float(run["summary"]["apply_s"])
        measured = statistics.median(max(st["fetch_s"]) for st in steps)
        if overhead is None:
            overhead = measured - max(wire, apply)
            out.append(Check(f"{name}: delta fetch (fit)", measured, measured, fitted=True))
            continue
        out.append(Check(f"{name}: delta fetch", overhead + max(wire, apply), measured))
    whole_measured = [max(f["fetch_s"]) for run in d["runs"].values() for f in run["full"]]
    whole = transfer(p, nbytes, pipelined=True)["last_s"]
    out.append(Check("whole fetch", whole, statistics.median(whole_measured)))
    return out


def calibrate_reshard(doc: Mapping[str, Any]) -> list[Check]:
    """`bench reshard --json`'s run against the sim, for each R of its `slices` series
    (every worker reads its blocks from the trainer's shards): one uplink per holder a
    worker read from and one downlink per worker, at the run's link rate, and each worker
    reading from each holder what that run counted (`worker_bytes_by_source`, the SDK's
    bytes per source: the chunks its blocks lie in, from the holder the planner chose), all
    at once, as `fetch_slices` reads up to four source shards (the bench's trainer hosts).
    Measured: T (the first publish to the last worker verified, median of the steps), so
    the publish is in it and not in the sim."""
    d = doc.get("details", doc)
    link = float(d["rate_mbit"]) * 1e6 * PAYLOAD / 8
    out = []
    for r, steps in sorted(d["steps"]["slices"].items(), key=lambda kv: int(kv[0])):
        if any("worker_bytes_by_source" not in s for s in steps):
            raise InvalidArgument("a bench reshard report without worker_bytes_by_source")
        workers = len(steps[0]["worker_bytes_by_source"])
        net = Network()
        up: dict[str, int] = {}
        for w in range(workers):
            down = net.link(f"worker{w}", link)
            sources = {k for s in steps for k in s["worker_bytes_by_source"][w]}
            for source in sorted(sources):
                size = statistics.median(
                    s["worker_bytes_by_source"][w].get(source, 0) for s in steps
                )
                if source not in up:
                    up[source] = net.link(source, link)
                if size > 0:
                    net.add(Flow((up[source], down), float(size)))
        out.append(Check(f"R={r} (from the trainer)", net.run(), float(d["T"]["slices"][r])))
    return out
