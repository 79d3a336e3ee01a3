"""The run's client processes: spawn, signal, restart, and a log of every incarnation.

A worker restarted after a kill is a new incarnation (`name#gen`), with a new holder name
and session, like a rollout worker that a scheduler brings back. The incarnation log
(start, end, how it ended) is what the checker uses to know which holder was alive when.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chaos.netns import Namespace
from consistency.embedded import stop_process

# they serve what they hold
HOLDER_ROLES = ("publisher", "reader", "rank", "shard-reader", "layout-reader")


@dataclass
class Incarnation:
    client: str
    started: float
    ended: float | None = None
    how: str = ""


@dataclass
class WorkerProcess:
    """One worker slot: its role, spec and current process; `holder` if it serves versions."""

    name: str
    role: str
    spec: dict[str, Any]
    root: Path
    netns: Namespace | None = None
    env: dict[str, str] = field(default_factory=dict)
    gen: int = 0
    process: subprocess.Popen[bytes] | None = None
    incarnations: list[Incarnation] = field(default_factory=list)
    paused: bool = False

    @property
    def holder(self) -> bool:
        return self.role in HOLDER_ROLES

    @property
    def client(self) -> str:
        return f"{self.name}#{self.gen}"

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def ready(self) -> bool:
        """The current incarnation has its signal handlers in place (it said so)."""
        try:
            return self.history_path().with_suffix(".ready").read_text() == str(self.gen)
        except OSError:
            return False

    def spawn(self) -> None:
        self.gen += 1
        spec = {**self.spec, "name": self.name, "gen": self.gen, "role": self.role}
        argv = [sys.executable, "-m", "chaos.roles", json.dumps(spec)]
        if self.netns is not None:
            argv = self.netns.prefix() + argv
        env = {**os.environ, **self.env}
        with (self.root / f"{self.name}.log").open("ab") as log:
            self.process = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
            )
        self.paused = False
        self.incarnations.append(Incarnation(self.client, time.monotonic()))

    def _ended(self, how: str) -> None:
        if self.incarnations and self.incarnations[-1].ended is None:
            self.incarnations[-1].ended = time.monotonic()
            self.incarnations[-1].how = how

    def send(self, sig: signal.Signals) -> bool:
        """Signal the live process; False if there is none."""
        if not self.alive or self.process is None:
            return False
        try:
            os.kill(self.process.pid, sig)
        except ProcessLookupError:
            return False
        return True

    def kill(self) -> None:
        if self.process is not None and self.send(signal.SIGKILL):
            self.process.wait(timeout=10)
        self._ended("SIGKILL")

    def pause(self) -> bool:
        self.paused = self.send(signal.SIGSTOP)
        return self.paused

    def resume(self) -> None:
        if self.paused:
            self.send(signal.SIGCONT)
            self.paused = False

    def finish(self, timeout: float) -> None:
        """Let the process end on its own (it knows the end time), else stop it."""
        self.resume()
        proc = self.process
        if proc is None:
            return
        try:
            proc.wait(timeout=max(0.1, timeout))
            self._ended(f"exit {proc.returncode}")
            return
        except subprocess.TimeoutExpired:
            pass
        self._ended(f"{stop_process(proc)} at the end")

    def reap(self) -> None:
        """Note an incarnation that died by itself (a crash is reported, never hidden)."""
        if self.process is not None and self.process.poll() is not None:
            self._ended(f"exit {self.process.returncode}")

    def history_path(self) -> Path:
        return Path(self.spec["history"])
