"""The driver's side of a run: place the actors on the cluster's nodes, step them, kill and
replace one rollout mid-run, and check every rollout's bytes against the trainer's.

A rollout is killed with `ray.kill` while it holds the latest version complete and serves it;
its replacement starts on the same node. The dead rollout's holder record stays in the hub
until its session's lease runs out, so the newcomer's nearest source is a dead port, and its
fetch reads around it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import ray
from ray.exceptions import GetTimeoutError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ray_sync.actors import Rollout, Trainer
from ray_sync.reports import Config, Step, Summary
from ray_sync.table import print_final, print_header, print_step
from tensorhub.errors import DeadlineExceeded, InvalidArgument, WeightSyncError

ACTOR_START_TIMEOUT = 120.0  # a new actor: a worker process that imports torch and the SDK
CLOSE_TIMEOUT = 30.0

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
    """`ray.get` of one ref or a list, under `timeout`; `DeadlineExceeded` naming `what`."""
    try:
        return ray.get(refs, timeout=timeout)
    except GetTimeoutError as exc:
        raise DeadlineExceeded(f"{what}: no answer within {timeout:.0f} s") from exc


class _Run:
    """The actors of one run, and where each rollout was placed."""

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
        one on the same node (another, if that node is gone) that catches up to the latest."""
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
    """One training run on the connected Ray cluster: `steps` versions, `rollouts` rollouts,
    one replaced after step `kill_at` (0: none). `WeightSyncError` when a rollout's bytes
    differ from the trainer's; the SDK's errors, and `DeadlineExceeded`, as they come."""
    if rollouts < 1 or steps < 1 or not 0 <= kill_at <= steps:
        raise InvalidArgument("need rollouts >= 1, steps >= 1 and 0 <= kill_at <= steps")
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
        print_header(summary, cfg.tenant, rollouts)
        for step in range(1, steps + 1):
            record = r.step(step, first + step - 1)
            if step == kill_at:
                r.replace_one(record)
            summary.steps.append(record)
            print_step(record)
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
        print_final(summary)
        return summary
    finally:
        _close(r.actors)


def _close(actors: Sequence[Any]) -> None:
    """Close every actor's hub client (bounded), then end the actors."""
    closing = [a.close.remote() for a in actors]
    ray.wait(closing, num_returns=len(closing), timeout=CLOSE_TIMEOUT)
    for actor in actors:
        ray.kill(actor, no_restart=True)
