"""Both ends of the tests that run a trainer's ranks as real processes in a gloo group.

The test side, `launch`: start `world` processes of a rank module (`python -m MODULE ARGS`)
with torch.distributed's environment on loopback, read the one JSON line each prints once
its publish returned, and stop them when the block ends (closing their stdin, then killing
what has not exited). The rank side, `rank_session` and `say_and_serve`: join the group,
connect to the hub, and serve the rank's memory until the test closes stdin.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager, suppress
from datetime import timedelta
from typing import IO, Any

from tensorhub.process_exit import exit_now

RANK_SECONDS = 120.0  # how long a rank may take to print its line (a slow 2-core machine)
GROUP_TIMEOUT = timedelta(seconds=60)  # gloo's own deadline on each collective


def free_port() -> int:
    """A loopback TCP port free now (for the group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def readline(proc: subprocess.Popen[str], seconds: float) -> str:
    """The process's next stdout line, or "" after `seconds` or at its end."""
    line: list[str] = []
    assert proc.stdout is not None
    stream = proc.stdout
    reader = threading.Thread(target=lambda: line.append(stream.readline()), daemon=True)
    reader.start()
    reader.join(seconds)
    return line[0] if line else ""


@contextmanager
def launch(
    module: str, args: Sequence[str], world: int, env: Mapping[str, str] | None = None
) -> Iterator[list[dict[str, Any]]]:
    """`world` rank processes of `module`: what each said (in rank order), while they serve.
    A rank that exits without a line says `{"exit": code, "stderr": its tail}`; one that
    says nothing in `RANK_SECONDS` fails the test."""
    base = {**os.environ, "PYTHONPATH": os.getcwd(), "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
            "OMP_NUM_THREADS": "1", **(env or {})}  # fmt: skip
    with ExitStack() as stack:
        errs = [stack.enter_context(tempfile.TemporaryFile("w+")) for _ in range(world)]
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", module, *args],
                env={**base, "RANK": str(rank)},
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=errs[rank],  # a file, never a full pipe
                text=True,
            )
            for rank in range(world)
        ]
        try:
            yield [_said(proc, err) for proc, err in zip(procs, errs, strict=True)]
        finally:
            _stop(procs)


def _said(proc: subprocess.Popen[str], err: IO[str]) -> dict[str, Any]:
    """The rank's JSON line, or how it ended without one."""
    line = readline(proc, RANK_SECONDS)
    if line:
        return dict(json.loads(line))
    try:
        code = proc.wait(timeout=10)  # its stdout ended: it is exiting
    except subprocess.TimeoutExpired:
        raise AssertionError(f"a rank said nothing in {RANK_SECONDS}s") from None
    err.seek(0)
    return {"exit": code, "stderr": err.read()[-3000:]}


def _stop(procs: Sequence[subprocess.Popen[str]]) -> None:
    """Close every rank's stdin (each then ends its serving), then kill the ones still up."""
    for proc in procs:
        if proc.stdin is not None and not proc.stdin.closed:
            with suppress(BrokenPipeError):
                proc.stdin.close()
    for proc in procs:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@contextmanager
def rank_session() -> Iterator[tuple[int, int]]:
    """This process's (rank, world) in the gloo group of its environment, left at the end."""
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=GROUP_TIMEOUT)
    try:
        yield rank, world
    finally:
        dist.destroy_process_group()


leave = exit_now  # a rank process ends so once main() returned (group left, hub closed)


def say_and_serve(said: Mapping[str, Any]) -> None:
    """Print `said` as the rank's one JSON line, then serve until the test closes stdin."""
    print(json.dumps(said), flush=True)
    sys.stdin.read()
