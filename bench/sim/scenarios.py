"""The three workloads of the ROS paper on a simulated cluster, TensorHub vs baselines.

Model of the cluster (all parameters on the command line, see `Params`): hosts of
`gpus_per_host` GPUs, one NIC of `nic_gbps` per GPU, rail-optimised (GPU g of every host
shares rail g). A rollout host serves one TP-`gpus_per_host` instance, so each GPU needs
1/`gpus_per_host` of the model over its own NIC: the rails are independent and identical,
so one rail is simulated (one endpoint per host) and GPU-seconds are multiplied by the
rails. Inside a dc the fabric is non-blocking; datacenters are joined by one WAN link of
`wan_gbps` (shared by the rails). The trainer pool holds the model sharded over its hosts
(each trainer endpoint holds 1/T of the rail's bytes).

TensorHub's source choice is the real planner: `transport.planner.pipeline_sources` picks
each reader's source from the holders registered before it (topology first), and
`transport.planner.plan` re-plans a reader's unfinished chunks when its source leaves.
Baselines: parameter server (trainers push to `ps` servers, then readers pull), P2P
(every reader pulls from the trainers), NCCL-style pipelined broadcast over a static group
(rebuilt, at `nccl_init_s`, on every membership change), and for cross-dc, every remote
reader pulling across the WAN.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bench.sim.engine import Flow, Network
from transport.planner import Candidate, Source, pipeline_plan, plan
from transport.topology import Topology

GB = 1e9


@dataclass(frozen=True)
class Params:
    """Cluster and workload parameters (defaults: like the ROS paper's 1,024-GPU runs)."""

    gpus: int = 1024
    gpus_per_host: int = 8
    nic_gbps: float = 400.0  # per GPU
    model_gb: float = 140.0  # e.g. a 70B model in bf16
    chunk_mb: float = 4.0
    trainer_fraction: float = 0.125  # share of hosts in the trainer pool
    ps_servers: int = 0  # parameter servers (0: as many as trainer hosts)
    wan_gbps: float = 800.0  # the inter-dc link, all rails together
    nccl_init_s: float = 10.0  # building an NCCL communicator over the group
    joiners: int = 64  # elastic: spot hosts that join
    arrival_window_s: float = 0.0  # elastic: joiners arrive uniformly over this (0: at once)
    leavers: int = 4  # elastic: complete holders that leave halfway through

    @property
    def hosts(self) -> int:
        return self.gpus // self.gpus_per_host

    @property
    def trainers(self) -> int:
        return max(1, round(self.hosts * self.trainer_fraction))

    @property
    def rail_bytes(self) -> float:
        return self.model_gb * GB / self.gpus_per_host

    @property
    def nic(self) -> float:
        return self.nic_gbps * GB / 8

    @property
    def chunk(self) -> float:
        return self.chunk_mb * 1e6

    @property
    def one_transfer(self) -> float:
        return self.rail_bytes / self.nic


class Cluster:
    """One rail: an up and a down link per host endpoint, and the WAN per direction."""

    def __init__(self, p: Params, dcs: dict[int, int]) -> None:
        self.net = Network()
        self.p = p
        self.topo: list[Topology] = []
        self.up: list[int] = []
        self.down: list[int] = []
        wan = p.wan_gbps * GB / 8 / p.gpus_per_host
        self.wan = {d: self.net.link(f"wan->dc{d}", wan) for d in dcs}
        for dc, count in dcs.items():
            for _ in range(count):
                i = len(self.topo)
                self.topo.append(Topology(f"dc{dc}", f"dc{dc}-r{i // 16}", f"h{i}"))
                self.up.append(self.net.link(f"up{i}", p.nic))
                self.down.append(self.net.link(f"down{i}", p.nic))

    def path(self, src: int, dst: int) -> tuple[int, ...]:
        if self.topo[src].dc == self.topo[dst].dc:
            return (self.up[src], self.down[dst])
        return (self.up[src], self.wan[int(self.topo[dst].dc[2:])], self.down[dst])


def _source(i: int, topo: Topology) -> Source:
    return Source(f"h{i}", f"h{i}", 0, topo)


def tensorhub_fetch(
    c: Cluster,
    readers: list[int],
    holders: list[int],
    slices: int,
    flows: dict[int, list[Flow]] | None = None,
    earlier: tuple[int, ...] = (),
) -> dict[int, list[Flow]]:
    """Each reader registers in order (after the PARTIAL readers `earlier`, whose flows are
    in `flows`) and reads every slice from the holder the real policy picks; flows from a
    PARTIAL holder are pipelined behind that holder's flow."""
    cand = [Candidate(_source(h, c.topo[h]), 0, True) for h in holders]
    cand += [Candidate(_source(h, c.topo[h]), 1 + k, False) for k, h in enumerate(earlier)]
    first = 1 + len(earlier)
    cand += [Candidate(_source(r, c.topo[r]), first + k, False) for k, r in enumerate(readers)]
    sources = pipeline_plan(cand)  # what each reader's own pipeline_sources call would pick
    flows = {} if flows is None else flows
    for r in readers:
        src = int(sources[f"h{r}"].holder_id[1:])
        flows[r] = []
        for s in range(slices):
            upstream = flows[src][s] if src in flows else None
            size = c.p.rail_bytes / slices
            f = Flow(c.path(src, r), size, upstream=upstream, lag=c.p.chunk, tag=f"{src}>{r}")
            flows[r].append(c.net.add(f))
    return flows


def _last(flows: list[Flow]) -> float:
    return max(f.done or 0.0 for f in flows)


def _pull(c: Cluster, readers: list[int], servers: list[int]) -> dict[int, list[Flow]]:
    """Every reader pulls its slice from each server (the P2P and PS pull pattern)."""
    size = c.p.rail_bytes / len(servers)
    return {r: [c.net.add(Flow(c.path(s, r), size)) for s in servers] for r in readers}


def nccl_broadcast(p: Params, members: int) -> float:
    """Pipelined ring broadcast of the rail's bytes in chunks over `members` ranks."""
    return (p.rail_bytes + (members - 1) * p.chunk) / p.nic


def standalone(p: Params) -> dict[str, Any]:
    """Trainer pool publishes, the whole rollout pool fetches. Total GPU stall = trainer
    GPUs x trainer stall + each rollout GPU's wait for its weights."""
    t, r = p.trainers, p.hosts - p.trainers
    trainer_gpus, rollout_gpus = t * p.gpus_per_host, r * p.gpus_per_host

    c = Cluster(p, {1: p.hosts})
    flows = tensorhub_fetch(c, list(range(t, p.hosts)), list(range(t)), t)
    c.net.run()
    # the trainer may release once every slice has one complete copy
    th_trainer = max(min(f.done or 0.0 for f in col) for col in zip(*flows.values(), strict=True))
    th_roll = [_last(fs) for fs in flows.values()]
    th = trainer_gpus * th_trainer + p.gpus_per_host * sum(th_roll)

    c = Cluster(p, {1: p.hosts})
    flows = _pull(c, list(range(t, p.hosts)), list(range(t)))
    c.net.run()
    p2p_roll = [_last(fs) for fs in flows.values()]
    p2p = trainer_gpus * max(p2p_roll) + p.gpus_per_host * sum(p2p_roll)

    servers = p.ps_servers or t
    push = p.rail_bytes / t / p.nic * max(1.0, t / servers)
    c = Cluster(p, {1: p.hosts + servers})
    flows = _pull(c, list(range(t, p.hosts)), list(range(p.hosts, p.hosts + servers)))
    c.net.run()
    ps_roll = [push + _last(fs) for fs in flows.values()]
    ps = trainer_gpus * push + p.gpus_per_host * sum(ps_roll)

    bcast = nccl_broadcast(p, p.hosts)
    nccl = (trainer_gpus + rollout_gpus) * bcast
    best = min(p2p, ps, nccl)
    return {
        "gpu_stall_s": {"tensorhub": th, "p2p": p2p, "param_server": ps, "nccl": nccl},
        "tensorhub_trainer_stall_s": th_trainer,
        "tensorhub_last_rollout_s": max(th_roll),
        "ratio": best / th,
        "target": 6.7,
    }


def elastic(p: Params) -> dict[str, Any]:
    """`joiners` spot hosts join a pool whose holders are complete; `leavers` of those
    holders leave halfway. Weight-update time: first arrival to the last joiner done."""
    t = p.trainers
    holders = list(range(t, p.hosts - p.joiners))
    joiners = list(range(p.hosts - p.joiners, p.hosts))
    c = Cluster(p, {1: p.hosts})
    gap = p.arrival_window_s / max(1, len(joiners) - 1)
    flows: dict[int, list[Flow]] = {}

    def join(k: int) -> Callable[[], None]:
        return lambda: _join(c, joiners[k], holders, flows, tuple(joiners[:k]))

    for k in range(len(joiners)):
        c.net.at(k * gap, join(k))
    leaving = holders[-p.leavers :] if p.leavers else []

    def leave() -> None:
        _leave(c, flows, leaving, holders)

    c.net.at(p.arrival_window_s + p.one_transfer / 2, leave)
    c.net.run()
    th = max(_last(fs) for fs in flows.values())

    c = Cluster(p, {1: p.hosts})
    pulled = _pull(c, joiners, list(range(t)))
    c.net.run()
    p2p = max(_last(fs) for fs in pulled.values()) + p.arrival_window_s
    changes = 1 if p.arrival_window_s == 0 else len(joiners)
    changes += 1 if p.leavers else 0
    nccl = changes * (p.nccl_init_s + nccl_broadcast(p, p.hosts))
    servers = p.ps_servers or t
    ps = p.arrival_window_s + len(joiners) * p.rail_bytes / servers / p.nic
    best = min(p2p, nccl, ps)
    return {
        "update_s": {"tensorhub": th, "p2p": p2p, "param_server": ps, "nccl": nccl},
        "ratio": best / th,
        "target": 4.8,
    }


def _join(
    c: Cluster, j: int, holders: list[int], flows: dict[int, list[Flow]], earlier: tuple[int, ...]
) -> None:
    tensorhub_fetch(c, [j], holders, 1, flows, earlier)


def _leave(c: Cluster, flows: dict[int, list[Flow]], leaving: list[int], pool: list[int]) -> None:
    """Holders leave: each reader reading from one re-plans its unfinished bytes onto the
    remaining complete holders of its tier with the real planner (`plan`)."""
    gone = {f"h{h}" for h in leaving}
    alive = [h for h in pool if f"h{h}" not in gone]
    for r, fs in flows.items():
        for f in list(fs):
            src = int(f.tag.split(">")[0])
            if f.done is not None or src not in leaving:
                continue
            c.net.drop(f)
            fs.remove(f)
            rest = f.size - f.sent
            n = max(1, int(rest // c.p.chunk))
            sources = [_source(h, c.topo[h]) for h in alive]
            each = int(rest / n)

            def chunk_bytes(_index: int, b: int = each) -> int:
                return b

            assigned = plan(list(range(n)), chunk_bytes, sources, c.topo[r])
            for holder, chunks in assigned.items():
                if chunks:
                    size = rest * len(chunks) / n
                    new = Flow(c.path(int(holder[1:]), r), size, tag=f"{holder[1:]}>{r}")
                    fs.append(c.net.add(new))


def crossdc(p: Params) -> dict[str, Any]:
    """Trainer pool in dc1, rollout pool in dc2. Trainer stall: until dc2 holds one copy
    of every slice (TensorHub) vs until every dc2 reader has pulled across (baseline)."""
    t = p.trainers
    r = p.hosts - t
    c = Cluster(p, {1: t, 2: r})
    flows = tensorhub_fetch(c, list(range(t, p.hosts)), list(range(t)), t)
    c.net.run()
    th = max(min(f.done or 0.0 for f in col) for col in zip(*flows.values(), strict=True))
    wan_bytes = c.net.bytes_on.get(c.wan[2], 0.0)
    c = Cluster(p, {1: t, 2: r})
    pulled = _pull(c, list(range(t, p.hosts)), list(range(t)))
    c.net.run()
    base = max(_last(fs) for fs in pulled.values())
    return {
        "trainer_stall_s": {"tensorhub": th, "pull_across": base},
        "wan_bytes_per_rail_over_model_rail": wan_bytes / p.rail_bytes,
        "ratio": base / th,
        "target": 19.0,
    }


SCENARIOS = {"standalone": standalone, "elastic": elastic, "crossdc": crossdc}
