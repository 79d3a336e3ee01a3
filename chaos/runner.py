"""A chaos run, start to end: cluster, workload, faults, history, check.

Modelled on etcd's robustness tests: start a real cluster, drive traffic from separate client
processes, inject one failure at a time (hold it a few seconds, recover, pause), record every
operation, then check the history. Everything started is stopped again on exit, on error and
on Ctrl-C (processes, proxies, the namespace and the work dir).
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chaos import failpoints
from chaos.checker import Facts, FaultWindow, Violation, check
from chaos.cluster import ChaosCluster, write_start_file
from chaos.deltas import READ_MODES
from chaos.history import Op, load_ops
from chaos.netns import Namespace, unavailable_reason
from chaos.planted import KNOWN as PLANTED_KNOWN
from chaos.processes import HOLDER_ROLES, WorkerProcess
from chaos.proxy import Proxy
from consistency.embedded import free_port
from tensorhub.errors import InvalidArgument, TensorHubError

READY_TIMEOUT = 150.0
END_GRACE = 40.0  # how long workers may take to finish their last call after the end


@dataclass
class RunConfig:
    duration: float = 60.0
    seed: int = 0
    faults: list[str] | None = None  # None: every failpoint available here
    planted: str = ""  # a test-only bug to plant in the clients (chaos.planted)
    readers: int = 2
    publishers: int = 2
    watchers: int = 2  # watcher-1 asks for versions only
    pollers: int = 1
    intruders: int = 1
    hold: tuple[float, float] = (1.5, 3.0)  # how long a fault lasts
    gap: tuple[float, float] = (0.8, 2.0)  # quiet time between faults
    session_ttl: int = 5
    keep: bool = False  # keep the work dir (histories, logs)
    progress: Callable[[str], None] | None = None
    ranks: int = 0  # the model-parallel workload (chaos.shards): shards per version, 0: none
    shard_readers: int = 2  # with ranks: readers of shards
    shard_fetches: int = 4  # shards each shard reader fetches of every version (at most ranks)
    layout_readers: int = 2  # with ranks: readers of blocks in a second layout (layout_readers)
    delta: bool = True  # publishers publish with delta=True, readers apply them (chaos.deltas)


WORKLOADS = ("whole", "model-parallel", "mixed")
MAX_RANKS = 64  # one process each
MAX_LAYOUT_READERS = 16  # one process each


def for_workload(name: str, ranks: int = 16, **options: Any) -> RunConfig:
    """The config of a named workload: `whole` (publishers of whole versions, readers,
    watchers, a poller, an intruder), `model-parallel` (`ranks` rank processes publishing
    one shard each of every version, shard readers, layout readers, the intruder) or `mixed`
    (both)."""
    if name not in WORKLOADS:
        raise InvalidArgument(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
    if name == "whole":
        return RunConfig(**options)
    if not 1 <= ranks <= MAX_RANKS:
        raise InvalidArgument(f"ranks must be 1..{MAX_RANKS} (one process each)")
    if name == "model-parallel":
        options = {"publishers": 0, "readers": 0, "watchers": 0, "pollers": 0, **options}
    return RunConfig(ranks=ranks, **options)


@dataclass
class FaultRecord:
    name: str
    scope: str
    target: str
    start: float
    end: float
    error: str = ""


@dataclass
class RunResult:
    config: RunConfig
    start: float
    end: float
    faults: list[FaultRecord]
    skipped: dict[str, str]
    ops: list[Op]
    violations: list[Violation]
    incarnations: list[dict[str, Any]]
    workdir: str
    cluster: dict[str, Any] = field(default_factory=dict)


def _say(config: RunConfig, text: str) -> None:
    if config.progress is not None:
        config.progress(text)


def _validate(config: RunConfig) -> None:
    unknown = set(config.faults or ()) - set(failpoints.NAMES)
    if unknown:
        raise InvalidArgument(
            f"unknown failpoint(s) {sorted(unknown)}; known: {', '.join(failpoints.NAMES)}"
        )
    if config.planted and config.planted not in PLANTED_KNOWN:
        raise InvalidArgument(f"unknown planted bug {config.planted!r}; known: {PLANTED_KNOWN}")
    if not 5 <= config.duration <= 3600:
        raise InvalidArgument("duration must be 5..3600 seconds")
    if not 0 <= config.ranks <= MAX_RANKS:
        raise InvalidArgument(f"ranks must be 0..{MAX_RANKS} (one process each)")
    if config.shard_fetches < 1:
        raise InvalidArgument("shard_fetches must be at least 1")
    if not 0 <= config.layout_readers <= MAX_LAYOUT_READERS:
        raise InvalidArgument(f"layout_readers must be 0..{MAX_LAYOUT_READERS}")


class _Run:
    """The state of one run; `execute()` does it all inside an ExitStack."""

    def __init__(self, config: RunConfig, stack: contextlib.ExitStack) -> None:
        self.config, self.stack = config, stack
        self.rng = random.Random(config.seed)
        self.root = Path(tempfile.mkdtemp(prefix=f"tensorhub-chaos-{os.getpid()}-"))
        if not config.keep:
            stack.push(self._remove_unless_failed)
        self.workers: list[WorkerProcess] = []
        self.faults: list[FaultRecord] = []

    def _remove_unless_failed(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> bool:
        """Remove the work dir after a run; keep it when the run failed, because the error
        may point at its logs (a hub or etcd member that did not start). Ctrl-C and SIGTERM
        (KeyboardInterrupt) still clean up."""
        if exc_type is None or issubclass(exc_type, KeyboardInterrupt):
            shutil.rmtree(self.root, True)
        else:
            print(f"kept the work dir for its logs: {self.root}", file=sys.stderr)
        return False

    def _proxy(self, listen: tuple[str, int], upstream: tuple[str, int]) -> Proxy:
        proxy = Proxy(listen, upstream).start()
        self.stack.callback(proxy.stop)
        return proxy

    def setup(self) -> failpoints.Env:
        config = self.config
        netns: Namespace | None = None
        if unavailable_reason() is None:
            netns = Namespace(os.getpid())
            self.stack.callback(netns.close)
            netns.create()
        cluster = ChaosCluster(self.root)
        self.stack.callback(cluster.close)
        cluster.start()
        self.cluster = cluster
        hubs = cluster.hub_addresses
        env = failpoints.Env(cluster, self.workers, {}, netns=netns)
        base = {
            "tenant": cluster.TENANT, "token": cluster.tokens[cluster.TENANT],
            "seed": config.seed, "start_file": str(self.root / "start.json"),
            "session_ttl": config.session_ttl, "model": "policy",
        }  # fmt: skip
        slots = [(f"publisher-{i}", "publisher") for i in range(config.publishers)]
        slots += [(f"reader-{i}", "reader") for i in range(config.readers)]
        for role, count in (
            ("watcher", config.watchers), ("poller", config.pollers),
            ("intruder", config.intruders),
        ):  # fmt: skip
            slots += [(f"{role}-{i}", role) for i in range(count)]
        if config.ranks:
            slots += [(f"rank-{i}", "rank") for i in range(config.ranks)]
            slots += [(f"shard-reader-{i}", "shard-reader") for i in range(config.shard_readers)]
            slots += [(f"layout-reader-{i}", "layout-reader") for i in range(config.layout_readers)]
        for k, (name, role) in enumerate(slots):
            spec: dict[str, Any] = {**base, "history": str(self.root / f"{name}.jsonl")}
            order = hubs[:]
            self.rng.shuffle(order)  # spread pick_first over the replicas
            spec["hubs"] = order
            in_ns = netns is not None and name == "publisher-0"
            if in_ns and netns is not None:
                spec["hubs"] = [self._proxy((netns.host_ip, 0), _split(h)).address for h in order]
                env.netns_worker = name
            if role in ("rank", "shard-reader", "layout-reader"):
                spec["ranks"], spec["fetches"] = config.ranks, config.shard_fetches
                index = int(name.rsplit("-", 1)[1])  # the rank, or the reader's number
                spec["index"] = index
                spec["offset"] = index * config.ranks // max(1, config.shard_readers)
            if role in HOLDER_ROLES:
                port, alias = free_port(), f"127.0.1.{k + 1}"
                host = netns.ns_ip if in_ns and netns is not None else "127.0.0.1"
                env.holder_proxies[name] = self._proxy((alias, port), (host, port))
                spec["listen"], spec["advertise"] = f"{host}:{port}", alias
            if name == "poller-0":  # the stale-replica failpoint's target
                env.poller_proxies = [self._proxy(("127.0.0.1", 0), _split(h)) for h in hubs]
                spec["hubs"] = [p.address for p in env.poller_proxies]
            if role == "intruder":
                spec["token"] = cluster.tokens[cluster.INTRUDER]
                spec["tenant"], spec["victim_tenant"] = cluster.INTRUDER, cluster.TENANT
            if role != "intruder":  # its client is built with the bug's hooks
                spec["planted"] = config.planted
            if role in ("publisher", "reader"):
                spec["delta"] = config.delta
            if role == "reader":  # reader-i reads in mode i mod 3
                spec["read_mode"] = READ_MODES[int(name.rsplit("-", 1)[1]) % len(READ_MODES)]
            self.workers.append(
                WorkerProcess(name, role, spec, self.root, netns if in_ns else None)
            )
        for w in self.workers:
            w.spec.setdefault("targets", [])
            if w.role == "intruder":
                w.spec["targets"] = [p.address for p in env.holder_proxies.values()]
        self.stack.callback(self._kill_workers)
        return env

    def _kill_workers(self) -> None:
        for w in self.workers:
            w.resume()
            if w.alive:
                w.kill()

    def start_workers(self) -> float:
        for w in self.workers:
            w.spawn()
        deadline = time.monotonic() + READY_TIMEOUT
        for w in self.workers:
            while not w.ready:
                if not w.alive or time.monotonic() > deadline:
                    raise TensorHubError(f"worker {w.name} did not start; see {self.root}")
                time.sleep(0.05)
        start = time.monotonic()
        write_start_file(self.root / "start.json", start + self.config.duration)
        return start

    def nemesis(self, env: failpoints.Env, start: float, end: float) -> dict[str, str]:
        """Inject one fault at a time, in a seeded order, until shortly before the end."""
        chosen = self.config.faults if self.config.faults is not None else failpoints.NAMES
        points = [fp(env) for fp in failpoints.ALL if fp.name in chosen]
        skipped = {fp.name: fp.reason for fp in points if not fp.available()}
        usable = [fp for fp in points if fp.available()]
        for name, reason in skipped.items():
            _say(self.config, f"skip {name}: {reason}")
        self.rng.shuffle(usable)
        turn = 0
        self._sleep_until(start + self.rng.uniform(*self.config.gap) + 1.0)
        while usable and time.monotonic() + self.config.hold[1] + 2.0 < end:
            fp = usable[turn % len(usable)]
            turn += 1
            t0 = time.monotonic()
            try:
                target = fp.inject(self.rng)
            except TensorHubError as exc:
                self.faults.append(FaultRecord(fp.name, fp.scope, "", t0, t0, str(exc)))
                _say(self.config, f"{t0 - start:7.2f}s {fp.name}: not injected ({exc})")
                continue
            _say(self.config, f"{t0 - start:7.2f}s inject {fp.name} on {target}")
            self._sleep_until(time.monotonic() + self.rng.uniform(*self.config.hold))
            error = ""
            try:
                fp.recover()
            except TensorHubError as exc:
                error = f"recover failed: {exc}"
            t1 = time.monotonic()
            self.faults.append(FaultRecord(fp.name, fp.scope, fp.target or target, t0, t1, error))
            _say(self.config, f"{t1 - start:7.2f}s recover {fp.name} {error}".rstrip())
            for w in self.workers:
                w.reap()
            self._sleep_until(time.monotonic() + self.rng.uniform(*self.config.gap))
        return skipped

    @staticmethod
    def _sleep_until(t: float) -> None:
        time.sleep(max(0.0, t - time.monotonic()))


def run(config: RunConfig) -> RunResult:
    """Do one chaos run and check its history; raises only if the run itself cannot start."""
    _validate(config)
    stack = contextlib.ExitStack()
    try:
        result = _execute(config, stack)
    except BaseException as exc:
        # The exit callbacks must see the error: `_remove_unless_failed` keeps the work dir
        # then (`stack.close()` would tell them the run went well, and delete the logs).
        stack.__exit__(type(exc), exc, exc.__traceback__)
        raise
    stack.close()
    return result


def _execute(config: RunConfig, stack: contextlib.ExitStack) -> RunResult:
    """The run itself; every cleanup it needs is pushed onto `stack`."""
    r = _Run(config, stack)
    _say(config, f"work dir {r.root}")
    env = r.setup()
    _say(config, f"cluster up: 3 etcd members, 2 hubs; starting {len(r.workers)} workers")
    start = r.start_workers()
    end = start + config.duration
    _say(config, f"running for {config.duration:.0f}s (seed {config.seed})")
    skipped = r.nemesis(env, start, end)
    r._sleep_until(end)
    for w in r.workers:
        w.finish(max(0.0, end + END_GRACE - time.monotonic()))
    finished = time.monotonic()
    ops = load_ops(w.history_path() for w in r.workers if w.history_path().exists())
    incarnations = [vars(i) for w in r.workers for i in w.incarnations]
    facts = Facts(
        ops,
        [FaultWindow(f.name, f.scope, f.target, f.start, f.end) for f in r.faults],
        {i["client"]: (i["started"], i["ended"] or finished) for i in incarnations},
        session_ttl=config.session_ttl,
    )
    violations = check(facts)
    return RunResult(
        config, start, finished, r.faults, skipped, ops, violations, incarnations,
        str(r.root), r.cluster.describe(),
    )  # fmt: skip


def _split(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host, int(port)
