"""The orchestrator's handle on one participant process running in an emulated host.

A participant reads one JSON command a line on stdin and answers one JSON line on stdout
(`bench.emu.participant`). A reader thread queues the answers so that the orchestrator can
send a command to many participants at once and then collect every answer, each with a
deadline: a participant that hangs or dies ends the benchmark with `ParticipantError`, not
a hang.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from bench.emu.netns import Emulation, Host
from tensorhub.errors import TensorHubError

Reply = dict[str, Any]


class ParticipantError(TensorHubError):
    """A participant failed a command, died, or did not answer before its deadline."""

    code = "INTERNAL"


class Participant:
    """`python -m bench.emu.participant` inside `host`'s namespace."""

    def __init__(
        self, emu: Emulation, host: Host, role: str, log: Path, env: dict[str, str] | None = None
    ) -> None:
        """`env`: set in the participant's environment on top of this process's (what a
        library reads when it starts, such as UCX's `UCX_*`, must be there from the start)."""
        self.host, self.role, self.log = host, role, log
        argv = emu.exec_argv(host, [sys.executable, "-m", "bench.emu.participant", host.ip])
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
            start_new_session=True, stderr=log.open("ab"),
        )  # fmt: skip
        self._replies: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout or ():
            if line.startswith("{"):
                self._replies.put(line)
        self._replies.put(None)

    def send(self, op: str, **args: Any) -> None:
        if self.proc.stdin is None or self.proc.poll() is not None:
            raise ParticipantError(f"{self.role} on {self.host.name} is not running")
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()

    def reply(self, timeout: float) -> Reply:
        try:
            line = self._replies.get(timeout=max(timeout, 0.0))
        except queue.Empty:
            raise ParticipantError(
                f"{self.role} on {self.host.name} did not answer in {timeout:.0f}s"
            ) from None
        if line is None:
            raise ParticipantError(
                f"{self.role} on {self.host.name} exited ({self.proc.wait(5)}): {self._tail()}"
            )
        answer: Reply = json.loads(line)
        if "error" in answer:
            raise ParticipantError(
                f"{self.role} on {self.host.name}: {answer['error']} ({self.log})"
            )
        return answer

    def call(self, op: str, timeout: float = 60.0, **args: Any) -> Reply:
        self.send(op, **args)
        return self.reply(timeout)

    def _tail(self) -> str:
        try:
            return " | ".join(self.log.read_text(errors="replace").splitlines()[-5:])
        except OSError:
            return "(no log)"

    def kill(self) -> None:
        """SIGKILL the participant (its whole process group)."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)


def gather(parts: Iterable[Participant], timeout: float) -> list[Reply]:
    """Every participant's next answer, all before one shared deadline."""
    end = time.monotonic() + timeout
    return [p.reply(end - time.monotonic()) for p in parts]


def broadcast(parts: Iterable[Participant], op: str, timeout: float, **args: Any) -> list[Reply]:
    """Send one command to all (back to back, so they start together), then gather."""
    group = list(parts)
    for p in group:
        p.send(op, **args)
    return gather(group, timeout)
