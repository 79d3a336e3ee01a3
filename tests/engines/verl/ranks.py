"""Actor ranks in processes of their own (tests/engines/verl/fsdp_rank_proc.py), driven in
step: `ActorRanks.all(op, ...)` sends one command to every rank and collects every answer
before one deadline, so a rank that hangs or dies fails the caller instead of hanging it."""

from __future__ import annotations

import json
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = str(Path(__file__).resolve().parents[3])


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ActorRanks:
    """`world` rank processes of `size` (`fsdp_rank_proc.SIZES`), publishing `model`."""

    def __init__(
        self,
        hub: str,
        tenant: str,
        token: str,
        model: str,
        size: str,
        world: int,
        timeout: float = 60.0,
    ) -> None:
        env = {**os.environ, "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(_port()), "OMP_NUM_THREADS": "1",
               "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}  # fmt: skip
        argv = [sys.executable, "-W", "ignore", "-m", "tests.engines.verl.fsdp_rank_proc",
                hub, tenant, token, model, size, str(timeout)]  # fmt: skip
        self.procs = [
            subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                cwd=ROOT,
                env={**env, "RANK": str(rank)},
            )
            for rank in range(world)
        ]
        self.answers: list[queue.Queue[str | None]] = []
        for proc in self.procs:
            answers: queue.Queue[str | None] = queue.Queue()
            threading.Thread(target=self._pump, args=(proc, answers), daemon=True).start()
            self.answers.append(answers)

    @staticmethod
    def _pump(proc: subprocess.Popen[str], answers: queue.Queue[str | None]) -> None:
        for line in proc.stdout or ():
            if line.startswith("{"):
                answers.put(line)
        answers.put(None)

    def collect(self, seconds: float) -> list[dict[str, Any]]:
        """Every rank's next answer, by rank, before one deadline."""
        end = time.monotonic() + seconds
        out = []
        for rank, answers in enumerate(self.answers):
            try:
                line = answers.get(timeout=max(end - time.monotonic(), 0.0))
            except queue.Empty:
                what = f"actor rank {rank} did not answer in {seconds:.0f}s"
                raise AssertionError(what) from None
            if line is None:
                raise AssertionError(f"actor rank {rank} exited ({self.procs[rank].wait(5)})")
            out.append(json.loads(line))
        return out

    def all(self, op: str, seconds: float = 60.0, **args: Any) -> list[dict[str, Any]]:
        """Send one command to every rank, then collect their answers (errors fail)."""
        for proc in self.procs:
            assert proc.stdin is not None
            proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
            proc.stdin.flush()
        answers = self.collect(seconds)
        errors = [a["error"] for a in answers if "error" in a]
        assert not errors, errors
        return answers

    def close(self) -> None:
        for proc in self.procs:
            if proc.stdin is not None and not proc.stdin.closed:
                proc.stdin.close()
        for proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
