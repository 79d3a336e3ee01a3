"""Weight sync on Ray with TensorHub: one trainer actor, N rollout actors, one replaced mid-run.

The trainer actor updates its weights in place and publishes each version from its own memory
(`hub.publish`), waits until one rollout holds a complete copy, and releases it before the next
update. Every rollout actor waits (a `versions_only` watch, under a deadline) for the version,
releases the one it held, fetches the new one in place into its model's own tensors
(`hub.fetch(..., into=...)`) and serves it to the other rollouts until the next one, so the
trainer serves only part of each step's copies (a table row shows how many MB came from
the trainer and how many from peers). After every step the driver checks each rollout's
bytes against the trainer's digest (sha256 over every tensor).

Mid-run (`--kill-at STEP`, after that step), one rollout actor is killed with `ray.kill`
while it holds the latest version complete and serves it, and a new one is started on the
same node: it catches up to the latest version, then follows the run like the others. The
dead rollout's holder record stays in the hub until its session's lease runs out (10 s), so
the newcomer's nearest source is a dead port, and its fetch reads around it. The run ends
with every live rollout on the final version, with the trainer's bytes (exit status 0), or
exits 1 naming the error: `WeightSyncError` (bytes differ, `WaitTimeout`) or the SDK's own
(e.g. `PermissionDenied` for a refused token).

Version numbers: a run continues the model's versions, from `latest() + 1`. A model's
versions are one monotonic sequence in the hub (a publish that is not newer than the latest
fails with `StaleVersion`), so a trainer restarted on the same model, or a second run on the
same tenant, publishes after what is there; and the rollouts wait for *this run's* versions,
which the trainer names, never for `latest() >= N`, which a previous run's versions would
satisfy at once (the first version of this example did that and failed its second run with
`VersionNotFound`). Readers that follow "latest" keep working across runs, and the previous
run's versions age out by retention. A model name per run would work too, but would leave
every old run's model behind in the tenant (its quota) and make every reader learn the new
name; pass `--model` to start a separate line of versions when that is what you want.
Run one trainer per model at a time.

Each actor's holder port binds to its Ray node's IP (`ray.util.get_node_ip_address()`) and
is advertised there, with the node as its topology `host`, so readers on the same node are
preferred as sources.

Usage (run it as a script: Ray ships its actors to the workers by value; the workers import
the `ros` SDK, so install this project on every node):

    ray start --head                                     # or any existing Ray cluster
    python deploy/ray/weight_sync.py --ray-address auto --hub 10.0.0.1:7600 \\
        --tenant team-a --token "$TENSORHUB_TOKEN" --rollouts 4 --steps 10
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import ray
import torch
from ray.exceptions import GetTimeoutError, RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

import ros
from consistency.watch import EventKind

MiB = 1 << 20
LAYERS = 4  # the stand-in policy: LAYERS square Linear layers, sized by --model-mb
REPLICAS = 1  # the trainer waits until this many rollouts hold each version complete
MAX_WATCH_EVENTS = 10_000  # a bound on the events one wait reads (versions only: few)
ACTOR_START_TIMEOUT = 120.0  # a new actor: a worker process that imports torch and the SDK
CLOSE_TIMEOUT = 30.0


class WeightSyncError(RuntimeError):
    """The run did not end with every live rollout on the trainer's final bytes."""


class WaitTimeout(WeightSyncError):
    """A version of this run was not published within the step's deadline."""


@dataclass(frozen=True)
class Config:
    hub: tuple[str, ...]  # the hub's replicas, HOST:PORT each
    tenant: str
    token: str
    model: str = "policy"
    model_mb: float = 8.0
    session_ttl: int = 10


@dataclass(frozen=True)
class TrainerReport:
    version: int
    digest: str
    seconds: float  # publish until released: the trainer's stall
    node: str


@dataclass(frozen=True)
class RolloutReport:
    name: str
    node: str
    version: int
    digest: str
    seconds: float  # waiting for the version, then fetching it
    fetch_s: float
    from_trainer: int  # bytes read from the trainer
    from_peers: int  # bytes read from other rollouts
    failed_sources: dict[str, str] = field(default_factory=dict)


@dataclass
class Step:
    step: int
    version: int
    trainer: TrainerReport
    rollouts: list[RolloutReport]
    killed: str | None = None  # the rollout killed after this step
    replacement: RolloutReport | None = None  # the one started instead: its catch-up
    replace_s: float = 0.0  # from the kill until the newcomer held the latest version

    @property
    def bytes_ok(self) -> bool:
        reports = [*self.rollouts, *([self.replacement] if self.replacement else [])]
        return all(r.digest == self.trainer.digest for r in reports)


@dataclass
class Summary:
    model: str
    first_version: int
    last_version: int
    nodes: list[str]
    trainer_node: str
    steps: list[Step] = field(default_factory=list)
    final: dict[str, RolloutReport] = field(default_factory=dict)  # live rollout -> its state
    wall_s: float = 0.0
    ok: bool = False


class Deadline:
    def __init__(self, seconds: float) -> None:
        self.at = time.monotonic() + seconds

    def left(self, what: str) -> float:
        """Seconds left; `WaitTimeout` naming `what` once there are none."""
        left = self.at - time.monotonic()
        if left <= 0:
            raise WaitTimeout(f"deadline passed: {what}")
        return left


def build_model(model_mb: float, seed: int | None) -> torch.nn.Module:
    """The same architecture on every actor; only the trainer's initial weights matter."""
    width = max(8, int(math.sqrt(model_mb * MiB / 4 / LAYERS)))
    if seed is not None:
        torch.manual_seed(seed)
    return torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(LAYERS)))


def digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """sha256 over every tensor's name and bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].detach().contiguous().view(torch.uint8).numpy().data)
    return h.hexdigest()


def connect(cfg: Config, name: str) -> ros.Hub:
    """This actor's hub client: its holder port on its Ray node's IP, the node as topology."""
    ip = str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]
    return ros.connect(
        list(cfg.hub),
        tenant=cfg.tenant,
        token=cfg.token,
        listen=f"{ip}:0",
        advertise=ip,
        topology={"host": ip},
        name=name,
        session_ttl=cfg.session_ttl,
    )


class Trainer:
    """The trainer actor's class (`TrainerActor` is it on Ray)."""

    def __init__(self, cfg: Config) -> None:
        torch.set_num_threads(1)
        self.cfg = cfg
        self.model = build_model(cfg.model_mb, seed=0)
        self.state = self.model.state_dict()  # the parameters' own memory
        self._hub: ros.Hub | None = None

    @property
    def hub(self) -> ros.Hub:
        if self._hub is None:
            raise WeightSyncError("the trainer has not started")
        return self._hub

    def start(self) -> int:
        """Connect (in a method, not `__init__`, so a refused token reaches the driver as the
        SDK's `PermissionDenied`), and say where this run starts: after every version already
        published (see the module docstring)."""
        self._hub = connect(self.cfg, f"ray-trainer-{os.getpid()}")
        return self.hub.latest(self.cfg.model) + 1

    def step(self, version: int, timeout: float) -> TrainerReport:
        """A stand-in optimizer step in place, then publish it from this memory, wait for one
        replica, release (leaving the `with`) so the next step may write these tensors."""
        deadline = Deadline(timeout)
        generator = torch.Generator().manual_seed(version)
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(torch.randn(p.shape, generator=generator), alpha=1e-3)
        sha = digest(self.state)
        left = deadline.left(f"publish {self.cfg.model}@{version}")
        start = time.monotonic()
        pub = self.hub.publish(self.cfg.model, version, self.state, timeout=left)
        with pub:  # leaving it releases (no force: a replica holds it by then)
            pub.wait_replicated(REPLICAS, timeout=deadline.left(f"replicate @{version}"))
        return TrainerReport(version, sha, time.monotonic() - start, self.hub.topology.host)

    def close(self) -> None:
        if self._hub is not None:
            self._hub.close()


class Rollout:
    """A rollout actor's class (`RolloutActor` is it on Ray)."""

    def __init__(self, cfg: Config, name: str) -> None:
        torch.set_num_threads(1)
        self.cfg = cfg
        self.name = name
        self.model = build_model(cfg.model_mb, seed=None)
        self.state = self.model.state_dict()  # fetched into in place, every version
        self._hub: ros.Hub | None = None
        self.held: ros.Held | None = None

    @property
    def hub(self) -> ros.Hub:
        if self._hub is None:
            raise WeightSyncError(f"{self.name} has not started")
        return self._hub

    def start(self) -> str:
        """Connect (as `Trainer.start`); the node this rollout runs on."""
        self._hub = connect(self.cfg, f"ray-{self.name}-{os.getpid()}")
        return self.node()

    def node(self) -> str:
        return self.hub.topology.host

    def refresh(self, version: int, timeout: float) -> RolloutReport:
        """Wait until `version` is published, then load exactly it."""
        deadline = Deadline(timeout)
        start = time.monotonic()
        self._await(version, deadline)
        return self._load(version, deadline, start)

    def catch_up(self, at_least: int, timeout: float) -> RolloutReport:
        """A newcomer: wait until this run has published `at_least`, then load the latest."""
        deadline = Deadline(timeout)
        start = time.monotonic()
        self._await(at_least, deadline)
        return self._load("latest", deadline, start)

    def current(self) -> RolloutReport:
        """What this rollout's memory holds now (the digest is computed again, not recalled)."""
        version = self.held.version if self.held is not None else 0
        return RolloutReport(self.name, self.node(), version, digest(self.state), 0.0, 0.0, 0, 0)

    def close(self) -> None:
        if self._hub is not None:  # stops serving what it holds; its records go with it
            self._hub.close()

    def _await(self, version: int, deadline: Deadline) -> None:
        """Return once `version` (or a later one) of the model is published; `WaitTimeout`
        at the deadline. The watch opens before `latest` is read, so no publish is missed."""
        what = f"{self.cfg.model}@{version} published"
        with self.hub.watch(self.cfg.model, versions_only=True) as events:
            if self.hub.latest(self.cfg.model, timeout=deadline.left(what)) >= version:
                return
            for _ in range(MAX_WATCH_EVENTS):
                event = events.get(deadline.left(what))
                if event is None:
                    break  # nothing within the time left: the deadline passed
                if event.kind is EventKind.VERSION_PUBLISHED and event.version >= version:
                    return
                if event.kind is EventKind.RESYNC:  # the watch fell behind: ask again
                    latest = self.hub.latest(self.cfg.model, timeout=deadline.left(what))
                    if latest >= version:
                        return
        raise WaitTimeout(f"{what}: not within the deadline ({MAX_WATCH_EVENTS} events at most)")

    def _load(self, version: int | str, deadline: Deadline, start: float) -> RolloutReport:
        """Stop serving the previous version, then fetch into the same tensors. No `force`:
        if this rollout is the last complete holder of a version the hub still retains, the
        release keeps it readable (copied once to host memory) instead of dropping it."""
        what = f"load {self.cfg.model}@{version}"
        if self.held is not None:
            self.held.release(timeout=deadline.left(what))
            self.held = None
        self.held = self.hub.fetch(
            self.cfg.model, version, into=self.state, timeout=deadline.left(what)
        )
        stats = self.held.stats
        trainer = sum(b for s, b in stats.bytes_per_source.items() if s.startswith("ray-trainer"))
        return RolloutReport(
            name=self.name,
            node=self.node(),
            version=self.held.version,
            digest=digest(self.state),
            seconds=time.monotonic() - start,
            fetch_s=stats.duration,
            from_trainer=trainer,
            from_peers=stats.total_bytes - trainer,
            failed_sources=dict(stats.failed_sources),
        )


# The actors hold no CPU slot, so the example fits small clusters; on GPUs a real trainer and
# real rollouts would ask for num_gpus=1 each.
TrainerActor = ray.remote(num_cpus=0)(Trainer)
RolloutActor = ray.remote(num_cpus=0)(Rollout)


def _alive_nodes() -> list[dict[str, Any]]:
    """The cluster's live nodes, the head first."""
    nodes = [n for n in ray.nodes() if n["Alive"]]  # type: ignore[no-untyped-call]
    return sorted(nodes, key=lambda n: "node:__internal_head__" not in n["Resources"])


def _on(node: Mapping[str, Any]) -> NodeAffinitySchedulingStrategy:
    return NodeAffinitySchedulingStrategy(node_id=node["NodeID"], soft=False)


def _get(refs: Any, timeout: float, what: str) -> Any:
    """`ray.get` of one ref or a list, under `timeout`; `WaitTimeout` naming `what` past it."""
    try:
        return ray.get(refs, timeout=timeout)
    except GetTimeoutError as exc:
        raise WaitTimeout(f"{what}: no answer within {timeout:.0f} s") from exc


class _Run:
    """The driver's side of one run: the actors, and where each rollout was placed."""

    def __init__(self, cfg: Config, step_timeout: float) -> None:
        self.cfg = cfg
        self.step_timeout = step_timeout
        self.nodes = _alive_nodes()
        self.trainer: Any = TrainerActor.options(scheduling_strategy=_on(self.nodes[0])).remote(cfg)
        self.actors: list[Any] = [self.trainer]  # every actor started: all are ended at the end
        self.live: dict[str, Any] = {}  # rollout name -> actor handle
        self.placed: dict[str, str] = {}  # rollout name -> the node ID it was placed on
        self.started = 0

    def start_rollout(self, node: Mapping[str, Any]) -> tuple[str, Any]:
        name = f"rollout-{self.started}"
        self.started += 1
        actor = RolloutActor.options(scheduling_strategy=_on(node)).remote(self.cfg, name)
        self.actors.append(actor)
        self.placed[name] = node["NodeID"]
        return name, actor

    def step(self, step: int, version: int) -> Step:
        """Publish `version`; every live rollout loads it; bytes compared by the caller."""
        published = self.trainer.step.remote(version, self.step_timeout)
        refs = {n: a.refresh.remote(version, self.step_timeout) for n, a in self.live.items()}
        wait = self.step_timeout + 10
        reports = [_get(ref, wait, f"{name} loading @{version}") for name, ref in refs.items()]
        return Step(step, version, _get(published, wait, f"publish @{version}"), reports)

    def replace_one(self, record: Step) -> None:
        """Kill a rollout that holds `record.version` complete and serves it, and start a new
        one on the same node (another, if that node is gone) that catches up to the latest.
        The dead one's holder record stays in the hub until its session's lease runs out, so
        the newcomer's nearest source is a dead port: its fetch must read around it."""
        victim = next(iter(self.live))
        ray.kill(self.live.pop(victim), no_restart=True)
        killed_at = time.monotonic()
        alive = _alive_nodes()
        node = next((n for n in alive if n["NodeID"] == self.placed[victim]), alive[0])
        name, actor = self.start_rollout(node)
        _get(actor.start.remote(), ACTOR_START_TIMEOUT, f"{name} start")
        wait = self.step_timeout
        record.replacement = _get(
            actor.catch_up.remote(record.version, wait), wait + 10, f"{name} catching up"
        )
        record.killed = victim
        record.replace_s = time.monotonic() - killed_at
        self.live[name] = actor


def run(cfg: Config, rollouts: int, steps: int, kill_at: int, step_timeout: float) -> Summary:
    """One training run on the connected Ray cluster (see the module docstring)."""
    if rollouts < 1 or steps < 1 or not 0 <= kill_at <= steps:
        raise ValueError("need rollouts >= 1, steps >= 1 and 0 <= kill_at <= steps")
    started = time.monotonic()
    r = _Run(cfg, step_timeout)
    try:
        for i in range(rollouts):  # the first rollout on another node than the trainer's
            name, actor = r.start_rollout(r.nodes[(i + 1) % len(r.nodes)])
            r.live[name] = actor
        starting = [a.start.remote() for a in r.live.values()]  # all start at once
        first: int = _get(r.trainer.start.remote(), ACTOR_START_TIMEOUT, "trainer start")
        _get(starting, ACTOR_START_TIMEOUT, "rollouts start")
        node_ips = [n["NodeManagerAddress"] for n in r.nodes]
        summary = Summary(cfg.model, first, first + steps - 1, node_ips, node_ips[0])
        print(
            f"model {cfg.model} of {cfg.tenant}: versions {first}..{first + steps - 1}, "
            f"{rollouts} rollouts on {len(node_ips)} nodes ({', '.join(node_ips)}), "
            f"trainer on {summary.trainer_node}",
            flush=True,
        )
        print(
            f"{'step':<5} {'version':<8} {'trainer s':<10} {'fetch s max':<12} "
            f"{'MB trainer':<11} {'MB peers':<9} {'rollouts':<9} bytes ok",
            flush=True,
        )
        for step in range(1, steps + 1):
            record = r.step(step, first + step - 1)
            if step == kill_at:
                r.replace_one(record)
            summary.steps.append(record)
            _print_step(record)
            if not record.bytes_ok:
                raise WeightSyncError(f"step {step}: a rollout's bytes differ from the trainer's")
        final = [a.current.remote() for a in r.live.values()]
        for report in _get(final, step_timeout, "final state"):
            summary.final[report.name] = report
        last = summary.steps[-1].trainer
        wrong = {
            n: f.version
            for n, f in summary.final.items()
            if f.digest != last.digest or f.version != last.version
        }
        if wrong:
            raise WeightSyncError(f"live rollouts not on @{last.version}'s bytes: {wrong}")
        summary.wall_s = time.monotonic() - started
        summary.ok = True
        print(
            f"final version {last.version}: {len(summary.final)} live rollouts, identical bytes "
            f"(sha256 {last.digest[:16]}), wall time {summary.wall_s:.1f}s; ok",
            flush=True,
        )
        return summary
    finally:
        _close(r.actors)


def _close(actors: Sequence[Any]) -> None:
    """Close every actor's hub client (bounded), then end the actors."""
    closing = [a.close.remote() for a in actors]
    ray.wait(closing, num_returns=len(closing), timeout=CLOSE_TIMEOUT)
    for actor in actors:
        ray.kill(actor, no_restart=True)


def _print_step(s: Step) -> None:
    reports = [*s.rollouts, *([s.replacement] if s.replacement else [])]
    mb_trainer = sum(r.from_trainer for r in reports) / MiB
    mb_peers = sum(r.from_peers for r in reports) / MiB
    print(
        f"{s.step:<5} {s.version:<8} {s.trainer.seconds:<10.3f} "
        f"{max(r.fetch_s for r in reports):<12.3f} {mb_trainer:<11.1f} {mb_peers:<9.1f} "
        f"{len(reports):<9} {'yes' if s.bytes_ok else 'NO'}",
        flush=True,
    )
    if s.killed and s.replacement:
        r = s.replacement
        around = f"; read around {len(r.failed_sources)} failed source(s)"
        print(
            f"      killed {s.killed} (ray.kill) holding version {s.version}; {r.name} started "
            f"on {r.node}, caught up to version {r.version} {s.replace_s:.1f}s after the kill"
            f"{around if r.failed_sources else ''}",
            flush=True,
        )


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="weight_sync.py",
        description="A trainer actor publishes N versions through a TensorHub hub; rollout "
        "actors fetch each in place and serve it to each other; one rollout is killed and "
        "replaced mid-run. Ends with every live rollout on the final version, bytes checked "
        "against the trainer's. Exit status 0 when that holds, 1 when it does not.",
        epilog="A run continues the model's versions from latest()+1, so repeated runs on one "
        "tenant work. The hub, tenant and token default to $TENSORHUB_HUB, $TENSORHUB_TENANT "
        "and $TENSORHUB_TOKEN (a token on the command line is visible to other users of the "
        "machine).",
    )
    env = os.environ.get
    ap.add_argument(
        "--hub",
        default=env("TENSORHUB_HUB"),
        help="hub address HOST:PORT (several: comma-separated replicas)",
    )
    ap.add_argument("--tenant", default=env("TENSORHUB_TENANT"), help="the tenant to run in")
    ap.add_argument("--token", default=env("TENSORHUB_TOKEN"), help="the tenant's token")
    ap.add_argument(
        "--ray-address",
        default=None,
        help="Ray cluster to join: HOST:PORT of its head, or 'auto' (default: $RAY_ADDRESS, "
        "else a new local single-node Ray)",
    )
    ap.add_argument("--model", default="policy", help="model name (default: policy)")
    ap.add_argument("--rollouts", type=int, default=4, help="rollout actors (default: 4)")
    ap.add_argument("--steps", type=int, default=10, help="versions to publish (default: 10)")
    ap.add_argument(
        "--model-mb", type=float, default=8.0, help="size of the weights in MiB (default: 8)"
    )
    ap.add_argument(
        "--kill-at",
        type=int,
        default=None,
        help="after this step, kill one rollout (holding that version) with ray.kill and "
        "start a new one that catches up; 0: none (default: the middle step)",
    )
    ap.add_argument(
        "--step-timeout",
        type=float,
        default=120.0,
        help="seconds each step's publish, wait and fetch may take (default: 120)",
    )
    ap.add_argument("--json", metavar="PATH", help="write the run's summary there as JSON")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    missing = [f"--{k}" for k in ("hub", "tenant", "token") if not getattr(args, k)]
    if missing:
        ap.error(f"{', '.join(missing)} required (or $TENSORHUB_HUB/_TENANT/_TOKEN)")
    kill_at = (args.steps + 1) // 2 if args.kill_at is None else args.kill_at
    if args.rollouts < 1 or args.steps < 1 or not 0 <= kill_at <= args.steps:
        ap.error("need --rollouts >= 1, --steps >= 1 and 0 <= --kill-at <= --steps")
    if args.model_mb <= 0 or args.step_timeout <= 0:
        ap.error("--model-mb and --step-timeout must be positive")
    hubs = [h.strip() for h in args.hub.split(",") if h.strip()]
    cfg = Config(tuple(hubs), args.tenant, args.token, args.model, args.model_mb)
    ray.init(address=args.ray_address, include_dashboard=False, log_to_driver=True)
    try:
        summary = run(cfg, args.rollouts, args.steps, kill_at, args.step_timeout)
    except (WeightSyncError, ros.TensorHubError, RayError) as exc:
        cause = getattr(exc, "cause", None)  # an actor's exception: the SDK's own, not Ray's
        shown = cause if isinstance(cause, BaseException) else exc
        print(f"weight sync failed: {type(shown).__name__}: {shown}", file=sys.stderr, flush=True)
        return 1
    finally:
        ray.shutdown()
    if args.json:
        with open(args.json, "w") as out:
            json.dump(asdict(summary), out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
