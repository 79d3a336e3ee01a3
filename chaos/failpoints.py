"""Failpoints: each a small object with `name`, `available()`, `inject()`, `recover()`.

`inject(rng)` picks a target, breaks it and returns the target's name; `recover()` undoes
it. `scope` tells the checker whom a fault may legitimately hurt: `holder` (the targeted
holder's versions and, for a pause, its own calls), `global` (every call of the run) or
`client` (only the targeted client). A failpoint that cannot run here says why in `reason`
and is skipped, never faked.
"""

from __future__ import annotations

import os
import random
import signal
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from chaos.cluster import ChaosCluster
from chaos.netns import Namespace
from chaos.processes import WorkerProcess
from chaos.proxy import Proxy
from tensorhub.errors import TensorHubError


class NoTarget(TensorHubError):
    """No process is in a state this failpoint can act on right now."""

    code = "FAILED_PRECONDITION"


@dataclass
class Env:
    """What failpoints act on."""

    cluster: ChaosCluster
    workers: list[WorkerProcess]
    holder_proxies: dict[str, Proxy]  # worker name -> proxy in front of its data plane
    poller_proxies: list[Proxy] = field(default_factory=list)
    netns: Namespace | None = None
    netns_worker: str = ""

    def holders(self, rng: random.Random) -> WorkerProcess:
        live = [w for w in self.workers if w.holder and w.alive and w.ready and not w.paused]
        if not live:
            raise NoTarget("no live holder")
        return rng.choice(live)


class Failpoint(ABC):
    """One kind of fault (module docstring): `name` as the run's report names it, `scope`
    whom it may hurt, and `reason` why it cannot run here ("" when it can)."""

    name = ""
    scope = "global"
    reason = ""

    def __init__(self, env: Env) -> None:
        self.env = env
        self.target = ""

    def available(self) -> bool:
        return not self.reason

    @abstractmethod
    def inject(self, rng: random.Random) -> str:
        """Break a target picked with `rng`; its name."""

    @abstractmethod
    def recover(self) -> None:
        """Undo what `inject` broke."""


class KillHolder(Failpoint):
    """SIGKILL a trainer or rollout process mid-transfer; recovery starts a new incarnation."""

    name, scope = "kill-holder", "holder"
    wait_for_transfer = 3.0

    def inject(self, rng: random.Random) -> str:
        """Prefer a reader caught in the middle of a fetch (a PARTIAL holder that is also
        serving the chunks it has); look for one for a few seconds, else take any holder."""
        deadline = time.monotonic() + self.wait_for_transfer
        while time.monotonic() < deadline:
            busy = [w for w in self.env.workers if w.alive and not w.paused and _mid_fetch(w)]
            if busy:
                worker = rng.choice(busy)
                self.target = worker.name
                worker.kill()
                return f"{worker.client} (mid-fetch)"
            time.sleep(0.01)
        worker = self.env.holders(rng)
        self.target = worker.name
        worker.kill()
        return worker.client

    def recover(self) -> None:
        for w in self.env.workers:
            if w.name == self.target and not w.alive:
                w.spawn()


def _mid_fetch(worker: WorkerProcess) -> bool:
    """Whether the worker's last history record is the invoke of a fetch."""
    return worker.role == "reader" and _mid(worker, "fetch")


def _mid_burst(worker: WorkerProcess) -> bool:
    """Whether a rank of the model-parallel workload is publishing its shard right now."""
    return (
        worker.role == "rank"
        and worker.alive
        and not worker.paused
        and _mid(worker, "publish-shard")
    )


def _mid(worker: WorkerProcess, f: str) -> bool:
    """Whether the worker's last history record is the invoke of an `f` operation."""
    try:
        with worker.history_path().open("rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 2048))
            last = fh.read().rstrip(b"\n").rsplit(b"\n", 1)[-1]
    except OSError:
        return False
    return b'"type":"invoke"' in last and f'"f":"{f}"'.encode() in last


def _wait_for_burst(workers: list[WorkerProcess], timeout: float) -> list[WorkerProcess]:
    """The ranks caught publishing their shard, polled for up to `timeout` seconds (none
    when the run has no ranks, or no burst came: the caller acts anyway)."""
    if not any(w.role == "rank" for w in workers):
        return []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        busy = [w for w in workers if _mid_burst(w)]
        if busy:
            return busy
        time.sleep(0.01)
    return []


class KillRank(KillHolder):
    """SIGKILL a rank of the model-parallel workload mid-burst: one caught between the
    invoke and the completion of its shard publish, so its shard may or may not have
    landed. Recovery starts a new incarnation, which publishes the version in flight again
    (the same bytes: a retried shard publish must be idempotent)."""

    name, scope = "kill-rank", "holder"

    def __init__(self, env: Env) -> None:
        super().__init__(env)
        if not any(w.role == "rank" for w in env.workers):
            self.reason = "no model-parallel ranks in this run (--workload model-parallel)"

    def inject(self, rng: random.Random) -> str:
        busy = _wait_for_burst(self.env.workers, self.wait_for_transfer)
        live = busy or [w for w in self.env.workers if w.role == "rank" and w.alive]
        if not live:
            raise NoTarget("no live rank")
        worker = rng.choice(live)
        self.target = worker.name
        worker.kill()
        return f"{worker.client}" + (" (mid-burst)" if busy else "")


class PauseHolder(Failpoint):
    """SIGSTOP a holder (a gray failure: its sockets stay open, nothing answers); SIGCONT."""

    name, scope = "pause-holder", "holder"

    def inject(self, rng: random.Random) -> str:
        worker = self.env.holders(rng)
        self.target = worker.name
        worker.pause()
        return worker.client

    def recover(self) -> None:
        for w in self.env.workers:
            if w.name == self.target:
                w.resume()


class KillEtcdLeader(Failpoint):
    """SIGKILL the etcd leader; recovery restarts it from its data dir."""

    name = "kill-etcd-leader"

    def inject(self, rng: random.Random) -> str:
        self.index = self.env.cluster.etcd.leader(timeout=10.0)
        self.env.cluster.etcd.kill(self.index)
        return f"etcd m{self.index}"

    def recover(self) -> None:
        self.env.cluster.etcd.restart(self.index, timeout=30.0)


class KillHub(Failpoint):
    """SIGKILL one hub replica; recovery restarts it (its proxy, the clients' address, stays).

    With ranks of the model-parallel workload in the run, it waits (a few seconds at most)
    for a burst, so the replica dies while ranks are publishing their shards through it."""

    name = "kill-hub"
    wait_for_burst = 3.0

    def inject(self, rng: random.Random) -> str:
        busy = _wait_for_burst(self.env.workers, self.wait_for_burst)
        self.index = rng.randrange(len(self.env.cluster.hubs))
        self.env.cluster.hubs[self.index].kill()
        return f"hub {self.index}" + (" (mid-burst)" if busy else "")

    def recover(self) -> None:
        self.env.cluster.restart_hub(self.index)


class _ProxyFault(Failpoint):
    """A fault made by the proxy in front of a link: `mode` (with `delay`) on the link
    `_pick` chooses, until `recover` sets it back to pass."""

    mode, delay = "blackhole", 0.0

    @abstractmethod
    def _pick(self, rng: random.Random) -> tuple[str, Proxy]:
        """The target's name and the proxy in front of its link."""

    def inject(self, rng: random.Random) -> str:
        self.target, self.proxy = self._pick(rng)
        self.proxy.set(self.mode, self.delay)
        return self.target

    def recover(self) -> None:
        self.proxy.set("pass")


class _HolderLink(_ProxyFault):
    scope = "holder"

    def _pick(self, rng: random.Random) -> tuple[str, Proxy]:
        worker = self.env.holders(rng)
        return worker.name, self.env.holder_proxies[worker.name]


class _HubLink(_ProxyFault):
    def _pick(self, rng: random.Random) -> tuple[str, Proxy]:
        index = rng.randrange(len(self.env.cluster.hub_proxies))
        return f"hub {index}", self.env.cluster.hub_proxies[index]


class BlackholeHolder(_HolderLink):
    """Drop all traffic to and from one holder's data plane (TCP proxy holds every byte)."""

    name = "blackhole-holder"


class DelayHolder(_HolderLink):
    """Delay every read forwarded to or from one holder's data plane by 150 ms."""

    name, mode, delay = "delay-holder", "delay", 0.15


class BlackholeHub(_HubLink):
    """Drop all traffic between clients and one hub replica."""

    name = "blackhole-hub"


class DelayHub(_HubLink):
    """Delay every read forwarded between clients and one hub replica by 100 ms."""

    name, mode, delay = "delay-hub", "delay", 0.1


class SqueezeLink(Failpoint):
    """`tc tbf` on the veth of the namespace a publisher runs in: 2 Mbit/s both ways."""

    name, scope = "squeeze-link", "holder"

    def __init__(self, env: Env) -> None:
        super().__init__(env)
        if env.netns is None:
            self.reason = "no network namespace in this run (needs root, `ip` and `tc`)"

    def inject(self, rng: random.Random) -> str:
        if self.env.netns is None:
            raise NoTarget(self.reason)
        self.env.netns.squeeze("2mbit")
        self.target = self.env.netns_worker
        return f"{self.target} ({self.env.netns.name})"

    def recover(self) -> None:
        if self.env.netns is not None:
            self.env.netns.unsqueeze()


class CorruptHolder(Failpoint):
    """One holder flips a byte in every chunk it sends (its memory stays intact)."""

    name, scope = "corrupt-holder", "holder"

    def inject(self, rng: random.Random) -> str:
        worker = self.env.holders(rng)
        self.target = worker.name
        worker.send(signal.SIGUSR1)
        return worker.client

    def recover(self) -> None:
        for w in self.env.workers:
            if w.name == self.target:
                w.send(signal.SIGUSR2)


class ExpireLease(Failpoint):
    """Revoke a holder's session lease early (as if its renewals were lost): its records go."""

    name, scope = "expire-lease", "holder"

    def inject(self, rng: random.Random) -> str:
        holders = [w for w in self.env.workers if w.holder and w.alive]
        rng.shuffle(holders)
        etcd = self.env.cluster.etcd_client()
        for worker in holders:
            leases = self.env.cluster.holder_leases(f"{worker.name}-g{worker.gen}-")
            if leases:
                for lease in leases:
                    etcd.lease_revoke(lease, timeout=5.0)
                self.target = worker.name
                return f"{worker.client} (lease {', '.join(f'{x:x}' for x in leases)})"
        raise NoTarget("no holder has a record right now")

    def recover(self) -> None:
        """Nothing to undo: the client notices and re-registers under a new session."""


class StaleReplica(Failpoint):
    """Route the poller to a hub serving a frozen copy of the data (split brain).

    Its answers carry revisions older than the poller has seen, so the revision floor must
    refuse them (invariant 3); with the floor switched off, the checker must see `latest`
    go backwards.
    """

    name, scope = "stale-replica", "client"

    def __init__(self, env: Env) -> None:
        super().__init__(env)
        if not env.poller_proxies:
            self.reason = "no poller in this run"
        else:
            env.cluster.prepare_stale()

    def inject(self, rng: random.Random) -> str:
        address = self.env.cluster.start_stale_hub()
        host, port = address.rsplit(":", 1)
        for proxy in self.env.poller_proxies:
            proxy.switch((host, int(port)))
        self.target = "poller-0"
        return f"poller-0 -> stale hub {address}"

    def recover(self) -> None:
        for proxy, hub in zip(self.env.poller_proxies, self.env.cluster.hub_proxies, strict=False):
            host, port = hub.address.rsplit(":", 1)
            proxy.switch((host, int(port)))
        self.env.cluster.stop_stale_hub()


ALL: tuple[type[Failpoint], ...] = (
    KillHolder, PauseHolder, KillEtcdLeader, KillHub, BlackholeHolder, DelayHolder,
    BlackholeHub, DelayHub, SqueezeLink, CorruptHolder, ExpireLease, StaleReplica, KillRank,
)  # fmt: skip
NAMES = tuple(fp.name for fp in ALL)
