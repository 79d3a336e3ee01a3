"""The trainer and rollout actors' classes (`driver` makes them Ray actors).

The trainer keeps float32 masters and publishes bfloat16 copies of them (what rollouts run),
refreshed in place after every update, from that memory; it waits until `REPLICAS` rollouts
hold each version complete and releases it before the next update. With `Config.delta` (the
default) it publishes with `delta=True`: the SDK keeps one more host copy of the published
weights and publishes each next version also as its changes. A rollout waits for a version
with a `versions_only` watch, releases the one it held, fetches the new one into its model's
own tensors (which hold the version before: with a delta, only the changes move) and serves
it to the other rollouts until the next one.
Each actor connects in `start`, not in `__init__`, so a refused token reaches the driver as
the SDK's `PermissionDenied`.
"""

from __future__ import annotations

import os
import time

import ray
import torch

import ros
from consistency.events import EventKind
from ray_sync.model import LEARNING_RATE, PUBLISHED, build_model, digest
from ray_sync.reports import Config, RolloutReport, TrainerReport
from tensorhub.errors import DeadlineExceeded, EngineNotReady

REPLICAS = 1  # the trainer waits until this many rollouts hold each version complete
MAX_WATCH_EVENTS = 10_000  # a bound on the events one wait reads (versions only: few)


class Deadline:
    """One step's deadline, shared by the calls the step makes."""

    def __init__(self, seconds: float) -> None:
        self.at = time.monotonic() + seconds

    def left(self, what: str) -> float:
        """Seconds left; `DeadlineExceeded` naming `what` once there are none."""
        left = self.at - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded(f"deadline passed: {what}")
        return left


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
    """The trainer actor's class."""

    def __init__(self, cfg: Config) -> None:
        torch.set_num_threads(1)
        self.cfg = cfg
        self.model = build_model(cfg.model_mb, seed=0)  # the float32 masters
        # what is published: bf16 copies of the masters, this memory every version
        self.state = {n: t.detach().to(PUBLISHED) for n, t in self.model.state_dict().items()}
        self._hub: ros.Hub | None = None

    @property
    def hub(self) -> ros.Hub:
        if self._hub is None:
            raise EngineNotReady("the trainer has not started")
        return self._hub

    def start(self) -> int:
        """Connect, and say where this run starts: after every version already published
        (a model's versions are one monotonic sequence, so a run continues it)."""
        self._hub = connect(self.cfg, f"ray-trainer-{os.getpid()}")
        return self.hub.latest(self.cfg.model) + 1

    def step(self, version: int, timeout: float) -> TrainerReport:
        """A stand-in optimizer step on the masters, their bf16 copies refreshed in place,
        then publish those from this memory, wait for one replica, release (leaving the
        `with`) so the next step may write these tensors."""
        deadline = Deadline(timeout)
        generator = torch.Generator().manual_seed(version)
        with torch.no_grad():
            for name, p in self.model.state_dict().items():
                p.add_(torch.randn(p.shape, generator=generator), alpha=LEARNING_RATE)
                self.state[name].copy_(p)
        sha = digest(self.state)
        left = deadline.left(f"publish {self.cfg.model}@{version}")
        start = time.monotonic()
        pub = self.hub.publish(
            self.cfg.model, version, self.state, timeout=left, delta=self.cfg.delta
        )
        with pub:  # leaving it releases (no force: a replica holds it by then)
            pub.wait_replicated(REPLICAS, timeout=deadline.left(f"replicate @{version}"))
        return TrainerReport(version, sha, time.monotonic() - start, self.hub.topology.host)

    def close(self) -> None:
        if self._hub is not None:
            self._hub.close()


class Rollout:
    """A rollout actor's class."""

    def __init__(self, cfg: Config, name: str) -> None:
        torch.set_num_threads(1)
        self.cfg = cfg
        self.name = name
        self.model = build_model(cfg.model_mb, seed=None, dtype=PUBLISHED)
        self.state = self.model.state_dict()  # fetched into in place, every version
        self._hub: ros.Hub | None = None
        self.held: ros.Held | None = None

    @property
    def hub(self) -> ros.Hub:
        if self._hub is None:
            raise EngineNotReady(f"{self.name} has not started")
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
        """Return once `version` (or a later one) of the model is published;
        `DeadlineExceeded` at the deadline. The watch opens before `latest` is read, so no
        publish is missed."""
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
        raise DeadlineExceeded(
            f"{what}: not within the deadline ({MAX_WATCH_EVENTS} events at most)"
        )

    def _load(self, version: int | str, deadline: Deadline, start: float) -> RolloutReport:
        """Stop serving the previous version, then fetch into the same tensors. No `force`:
        if this rollout is the last complete holder of a version the hub still retains, the
        release keeps it readable (copied once to host memory) instead of dropping it. The
        tensors hold the version before, so a delta version moves only its changes."""
        what = f"load {self.cfg.model}@{version}"
        if self.held is not None:
            self.held.release(timeout=deadline.left(what))
            self.held = None
        self.held = self.hub.fetch(
            self.cfg.model, version, into=self.state, timeout=deadline.left(what),
            delta=self.cfg.delta,
        )  # fmt: skip
        stats = self.held.stats
        delta = self.held.delta
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
            delta_bytes=0 if delta is None else delta.encoded_bytes,
            delta_chunks=0 if delta is None else delta.chunks,
        )
