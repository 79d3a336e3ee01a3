"""The demo's driver: starts etcd, a hub and the workers, routes rewards, keeps the score.

It owns every resource it starts (etcd, hub, worker processes, sockets) in one ExitStack,
so a failure or Ctrl-C anywhere tears all of it down. Every wait has a deadline.
"""

from __future__ import annotations

import contextlib
import secrets
import subprocess
import sys
import time
from dataclasses import asdict, replace
from typing import Any

import ros
from consistency import EtcdCluster
from consistency.events import EventKind
from ros.client.watch import HubWatch
from ros.demo.channel import Driver, Inbound
from ros.demo.config import MODEL, TRAINER, DemoConfig, rollout_name
from ros.demo.display import Display, short
from ros.demo.report import MB, Fetch, Report, Step
from ros.hub.server import HubServer
from ros.hub.tenants import TenantStore
from tensorhub.errors import DeadlineExceeded, DemoFailed, TensorHubError

TENANT = "demo"
STARTUP_TIMEOUT = 120.0  # workers import torch and build the model first


# Messages about one version's step; one that arrives before the step exists waits for it.
_ABOUT_A_STEP = ("released", "fetched", "fetch_failed", "rewards", "trained", "mid_fetch")


class DemoRun:
    """One run of the demo; `run()` returns its report."""

    def __init__(self, cfg: DemoConfig, display: Display) -> None:
        self.cfg = cfg
        self.display = display
        self.report = Report(config=asdict(cfg))
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.alive: set[str] = set()
        self.steps: dict[int, Step] = {}
        self.done = False
        self.interrupted = False
        self.killed_at: float | None = None
        self._batch_items: dict[int, list[dict[str, Any]]] = {}
        self._sent: set[int] = set()
        # A rollout's report can beat the trainer's "published" for the same version (they
        # come over different sockets): kept here until the step exists, never dropped.
        self._early: dict[int, list[tuple[str, dict[str, Any]]]] = {}

    # -- set-up ----------------------------------------------------------------------------

    def run(self) -> Report:
        start = time.monotonic()
        try:
            with contextlib.ExitStack() as stack:
                try:
                    self._start(stack)
                    self._loop()
                    self._await_vanished()
                    self._stop_workers()
                except KeyboardInterrupt:
                    self.interrupted = True  # tear down fast: etcd got the Ctrl-C too
                    raise
        except TensorHubError as exc:
            self.report.errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            self.display.finish()
            self.report.wall_s = time.monotonic() - start
            self.report.steps = [self.steps[v] for v in sorted(self.steps)]
            self.report.config = {k: v for k, v in asdict(self.cfg).items() if k != "token"}
        return self.report

    def _start(self, stack: contextlib.ExitStack) -> None:
        self.display.status("starting etcd and the hub ...")
        etcd = stack.enter_context(EtcdCluster(size=1, auth=True))  # only the hub can read it
        # retain=2 (the default): the rollouts update in place, and the last complete holder
        # of the previous version spills it to host memory as it releases it (docs/demo.md).
        server = HubServer(
            etcd.endpoints, admin_token=secrets.token_urlsafe(16), retain=2,
            etcd_credentials=etcd.credentials,
        ).start()  # fmt: skip
        stack.callback(server.stop, 0.5)
        token = TenantStore(server.etcd, server.keys).create(TENANT)
        self.driver = Driver()
        stack.callback(self.driver.close)
        self.cfg = replace(
            self.cfg, hub=server.address, tenant=TENANT, token=token, driver_port=self.driver.port
        )
        self.observer = ros.connect(server.address, tenant=TENANT, token=token, name="observer")
        stack.callback(lambda: None if self.interrupted else self.observer.close())
        self.watch: HubWatch = stack.enter_context(self.observer.watch(MODEL))
        stack.callback(self._kill_all)
        env = self.cfg.to_env()
        names = [TRAINER] + [rollout_name(i) for i in range(self.cfg.rollouts)]
        for name in names:
            args = ["trainer"] if name == TRAINER else ["rollout", name.rsplit("-", 1)[1]]
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", "ros.demo.worker", *args],
                env=env,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # Ctrl-C reaches the driver only; it kills them
            )
        self.display.status(f"starting the trainer and {self.cfg.rollouts} rollouts ...")
        ready: set[str] = set()
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while ready != set(names):
            item = self._next(deadline, "workers to start")
            if item.message["type"] == "eof":
                raise DemoFailed(f"{item.sender} exited during start-up")
            if item.message["type"] == "ready":
                ready.add(item.sender)
        self.alive = set(names) - {TRAINER}
        mb = self.cfg.model_mb
        self.display.line(
            f"hub {server.address}, etcd {etcd.endpoints[0]}; trainer + {self.cfg.rollouts} "
            f"rollouts ready; {mb:g} MB model, {self.cfg.steps} steps"
        )
        self.driver.send(TRAINER, {"type": "start"})

    def _next(self, deadline: float, what: str) -> Inbound:
        while True:
            self._poll_watch()
            item = self.driver.next(min(0.2, deadline - time.monotonic()))
            if item is not None:
                return item
            if time.monotonic() >= deadline:
                raise DeadlineExceeded(f"gave up waiting for {what}")
            for name, proc in self.procs.items():
                if name == TRAINER and proc.poll() not in (None, 0):
                    raise DemoFailed(f"the trainer exited with status {proc.returncode}")

    # -- the run ---------------------------------------------------------------------------

    def _loop(self) -> None:
        deadline = time.monotonic() + self.cfg.step_timeout
        while not self.done:
            item = self._next(deadline, "the next step")
            if self._handle(item.sender, item.message):
                deadline = time.monotonic() + self.cfg.step_timeout

    def _handle(self, sender: str, m: dict[str, Any]) -> bool:
        """Apply one message; True when it is progress (resets the step deadline)."""
        kind = m["type"]
        version = int(m.get("version", 0))
        step = self.steps.get(version)
        if step is None and kind in _ABOUT_A_STEP:
            self._early.setdefault(version, []).append((sender, m))
            return True
        if kind == "published":
            self.steps[version] = Step(
                version, version, int(m["bytes"]), str(m["digest"]), float(m["t"]),
                publish_s=float(m["publish_s"]), delta_published=int(m["delta_bytes"]),
            )  # fmt: skip
            self.display.status(f"v{version}: published, waiting for one replica ...")
            for early_sender, early in self._early.pop(version, []):
                self._handle(early_sender, early)
        elif kind == "released" and step is not None:
            step.trainer_stall_s = float(m["stall_s"])
        elif kind == "fetching":
            self.display.status(f"v{version}: {short(sender)} fetching ...")
        elif kind == "mid_fetch" and sender == self.cfg.victim:
            self._kill(sender, version, float(m["done"]))
        elif kind == "fetched" and step is not None:
            step.fetches[sender] = Fetch(
                sources={str(k): int(n) for k, n in m["sources"].items()},
                fetch_s=float(m["fetch_s"]),
                stall_s=float(m["t"]) - step.t_publish,
                verified=m["digest"] == step.digest,
                failed_sources={str(k): str(v) for k, v in m["failed_sources"].items()},
                delta_bytes=int(m["delta_bytes"]),
                delta_chunks=int(m["delta_chunks"]),
            )
            got = "+".join(short(s) for s in m["sources"])
            how = f"delta {int(m['delta_bytes']) / MB:.2f} MB" if m["delta_bytes"] else ""
            self.display.status(
                f"v{version}: {short(sender)} has it (from {'+'.join(p for p in (got, how) if p)})"
            )
            if sender == self.cfg.victim and version == self.cfg.kill_at:
                self._kill(sender, version, 1.0)  # a one-chunk model cannot freeze mid-fetch
        elif kind == "fetch_failed" and step is not None:
            step.fetch_failures[sender] = str(m["error"])
            self._maybe_send_batch(step)
        elif kind == "rewards" and step is not None and sender in self.alive:
            step.rewards[sender] = float(m["reward"])
            self._batch_items.setdefault(version, []).append(
                {"seed": m["seed"], "actions": m["actions"]}
            )
            self._maybe_send_batch(step)
        elif kind == "trained" and step is not None:
            step.loss = float(m["loss"])
            self.display.step_done(step, self.cfg.steps)
        elif kind == "done":
            self.done = True
        elif kind == "eof":
            if sender == TRAINER and not self.done:
                raise DemoFailed("the trainer's connection closed before the last step")
            if sender in self.alive:
                self.alive.discard(sender)
                if sender != self.report.killed:
                    self.display.line(f"{sender} exited unexpectedly; going on without it")
                for pending in self.steps.values():
                    self._maybe_send_batch(pending)
            return False
        return True

    def _maybe_send_batch(self, step: Step) -> None:
        """Forward the rewards of a version to the trainer once every live rollout reported."""
        if not self.alive:
            raise DemoFailed("every rollout is gone")
        v = step.version
        if v in self._sent:
            return
        reported = set(step.rewards) | set(step.fetch_failures)
        if not self.alive <= reported:
            return
        items = self._batch_items.get(v, [])
        if not items:
            raise DemoFailed(f"no rollout could fetch v{v}: {step.fetch_failures}")
        self._sent.add(v)
        self.driver.send(TRAINER, {"type": "batch", "version": v, "items": items})

    # -- failover --------------------------------------------------------------------------

    def _kill(self, name: str, version: int, fraction: float) -> None:
        proc = self.procs[name]
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        self.killed_at = time.monotonic()
        self.alive.discard(name)
        self.report.killed = name
        step = self.steps[version]
        step.killed, step.killed_at_fraction = name, fraction
        step.fetches.pop(name, None)
        self.display.line(
            f"step {version}: SIGKILLed {name} with {fraction:.0%} of v{version} fetched; "
            f"the others fail over, its lease expires in <= {self.cfg.session_ttl}s"
        )
        for pending in self.steps.values():
            self._maybe_send_batch(pending)

    def _poll_watch(self) -> None:
        """Notice the killed rollout's holder records disappearing (lease expiry)."""
        while (event := self.watch.get(0)) is not None:
            if (
                event.kind is EventKind.HOLDER_REMOVED
                and self.killed_at is not None
                and event.holder_name == self.report.killed
                and self.report.killed_records_vanished_s is None
            ):
                gone = self.report.killed_records_vanished_s = time.monotonic() - self.killed_at
                self.display.line(
                    f"{event.holder_name}'s lease expired: its holder record of "
                    f"v{event.version} vanished {gone:.1f}s after the SIGKILL"
                )

    def _await_vanished(self) -> None:
        if self.killed_at is None or self.report.killed_records_vanished_s is not None:
            return
        self.display.status(f"waiting for {self.report.killed}'s lease to expire ...")
        deadline = self.killed_at + self.cfg.session_ttl + 15.0
        while self.report.killed_records_vanished_s is None and time.monotonic() < deadline:
            self._poll_watch()
            time.sleep(0.1)
        if self.report.killed_records_vanished_s is None:
            self.report.errors.append(f"{self.report.killed}'s holder records did not vanish")

    # -- tear-down -------------------------------------------------------------------------

    def _stop_workers(self) -> None:
        for name in self.alive:
            self.driver.send(name, {"type": "stop"})
        deadline = time.monotonic() + 30.0
        for name, proc in self.procs.items():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.report.errors.append(f"{name} did not exit after stop; killed")
                continue
            if proc.returncode not in (0, -9) and name != self.report.killed:
                self.report.errors.append(f"{name} exited with status {proc.returncode}")

    def _kill_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
