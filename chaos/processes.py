"""The run's client processes: spawn, signal, restart, and a log of every incarnation.

A worker restarted after a kill is a new incarnation (`name#gen`), with a new holder name
and session, like a rollout worker that a scheduler brings back. The incarnation log
(start, end, how it ended) is what the checker uses to know which holder was alive when.

A worker outside a network namespace is forked from a fork server that has imported
`chaos.roles` (torch, about 1.4 s of CPU a process, 8-20 processes a run on two cores) once
per test process; each is still a process of its own, signalled by its pid.
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
from typing import Any, Protocol

from chaos.netns import Namespace
from consistency.embedded import Stoppable, stop_process
from tensorhub.fork_server import fork_context
from tensorhub.process_exit import exit_now

# they serve what they hold
HOLDER_ROLES = ("publisher", "reader", "rank", "shard-reader", "layout-reader")


class Process(Stoppable, Protocol):
    """What the run needs of a worker's process: `stop_process`'s calls, its pid (the
    faults signal it) and its exit code, as `subprocess.Popen` has them."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...


class Forked:
    """A worker forked from the fork server, with `subprocess.Popen`'s calls (`wait`
    raises `subprocess.TimeoutExpired`), so that `stop_process` and the faults treat it
    as any child process."""

    def __init__(self, argv: list[str], log: Path, env: dict[str, str]) -> None:
        ctx = fork_context("chaos.roles")
        self.argv = argv
        self._proc = ctx.Process(target=_forked_main, args=(argv, str(log), env), daemon=False)
        self._proc.start()

    @property
    def pid(self) -> int:
        pid = self._proc.pid
        assert pid is not None  # started in __init__
        return pid

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def poll(self) -> int | None:
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        code = self._proc.exitcode
        if code is None:
            raise subprocess.TimeoutExpired(self.argv, timeout or 0.0)
        return code

    def terminate(self) -> None:
        self._proc.terminate()

    def kill(self) -> None:
        self._proc.kill()


def _forked_main(argv: list[str], log: str, env: dict[str, str]) -> None:
    """The forked worker: its output to its log, as a spawned one's, then `chaos.roles`."""
    from chaos import roles

    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.close(null)
    os.environ.clear()  # the caller's environment at start, not the fork server's
    os.environ.update(env)
    exit_now(roles.main(argv))


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
    process: Process | None = None
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
        log_path = self.root / f"{self.name}.log"
        env = {**os.environ, **self.env}
        if self.netns is None:
            self.process = Forked(argv[3:], log_path, env)
        else:  # entered by `ip netns exec`: a process of its own making
            argv = self.netns.prefix() + argv
            with log_path.open("ab") as log:
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
