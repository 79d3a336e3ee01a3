"""Both ends of the tests that run a trainer's ranks as real processes in a gloo group.

The test side, `launch`: start `world` processes of a rank module with torch.distributed's
environment on loopback, read the one JSON line each prints once its publish returned, and
stop them when the block ends (closing their stdin, then killing what has not exited). Each
rank is forked from the process's fork server (`tensorhub.fork_server`), which imported the
rank modules, torch and transformers once (`PRELOAD`): 2-4 s of CPU a rank otherwise, and a
test starts 2-4 ranks at once on two cores. Its stdin and stdout are one end of a socket
pair, its stderr a file. The rank side, `rank_session` and `say_and_serve`: join the group,
connect to the hub, and serve the rank's memory until the test closes stdin.
"""

from __future__ import annotations

import importlib
import json
import os
import socket
import sys
import tempfile
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager, suppress
from datetime import timedelta
from multiprocessing.process import BaseProcess
from typing import IO, Any

from tensorhub.fork_server import fork_context
from tensorhub.process_exit import exit_now

RANK_SECONDS = 120.0  # how long a rank may take to print its line (a slow 2-core machine)
GROUP_TIMEOUT = timedelta(seconds=60)  # gloo's own deadline on each collective
# What the fork server imports once for every rank (tests/conftest.py names them too).
PRELOAD = (
    "tests.gloo_ranks",
    "tests.ros.dtensor_rank_proc",
    "tests.ros.group_rank_proc",
    "tests.views.shard_publish_proc",
    "transformers.models.llama.modeling_llama",
)


class Rank:
    """One rank process: its pid and exit code, its stdout read a line at a time, and its
    stdin, which the test closes to end its serving."""

    def __init__(self, module: str, args: Sequence[str], env: Mapping[str, str], err: str):
        mine, theirs = socket.socketpair()
        self._channel = mine
        self._lines = mine.makefile("r", encoding="utf-8")
        self._process: BaseProcess = fork_context(*PRELOAD).Process(
            target=_rank_main, args=(module, list(args), dict(env), theirs, err), daemon=False
        )
        self._process.start()
        theirs.close()

    def readline(self, seconds: float) -> str:
        """Its next stdout line, or "" after `seconds` or at its end."""
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(self._lines.readline()), daemon=True)
        reader.start()
        reader.join(seconds)
        return line[0] if line else ""

    def close_stdin(self) -> None:
        with suppress(OSError):
            self._channel.shutdown(socket.SHUT_WR)

    def wait(self, seconds: float) -> int | None:
        """Its exit code, or None if it is still running after `seconds`."""
        self._process.join(seconds)
        return self._process.exitcode

    def kill(self) -> None:
        self._process.kill()

    def close(self) -> None:
        self._lines.close()
        self._channel.close()


def _rank_main(module: str, args: list[str], env: dict[str, str], channel: socket.socket,
               err: str) -> None:  # fmt: skip
    """The forked rank: `channel` as its stdin and stdout, `err` as its stderr, the test's
    environment, then `python -m module args`'s `main()`."""
    log = os.open(err, os.O_WRONLY | os.O_APPEND)
    os.dup2(channel.fileno(), 0)
    os.dup2(channel.fileno(), 1)
    os.dup2(log, 2)
    channel.close()
    os.close(log)
    sys.stdin = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115 (the process's own)
    sys.stdout = open(1, "w", encoding="utf-8", closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", encoding="utf-8", buffering=1, closefd=False)  # noqa: SIM115
    os.environ.clear()  # the test's environment, not the fork server's
    os.environ.update(env)
    import torch  # imported by the fork server already, before OMP_NUM_THREADS was set

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    sys.argv = [module, *args]
    exit_now(importlib.import_module(module).main())


@contextmanager
def launch(
    module: str, args: Sequence[str], world: int, env: Mapping[str, str] | None = None
) -> Iterator[list[dict[str, Any]]]:
    """`world` rank processes of `module`: what each said (in rank order), while they serve.
    A rank that exits without a line says `{"exit": code, "stderr": its tail}`; one that
    says nothing in `RANK_SECONDS` fails the test."""
    store = rendezvous_store(GROUP_TIMEOUT)  # serves while this generator runs
    base = {**os.environ, "PYTHONPATH": os.getcwd(), "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
            "OMP_NUM_THREADS": "1", **(env or {})}  # fmt: skip
    with ExitStack() as stack:
        errs = [stack.enter_context(tempfile.NamedTemporaryFile("w+")) for _ in range(world)]
        ranks = [
            Rank(module, args, {**base, "RANK": str(rank)}, errs[rank].name)
            for rank in range(world)
        ]
        try:
            yield [_said(rank, err) for rank, err in zip(ranks, errs, strict=True)]
        finally:
            _stop(ranks)


def _said(rank: Rank, err: IO[str]) -> dict[str, Any]:
    """The rank's JSON line, or how it ended without one."""
    line = rank.readline(RANK_SECONDS)
    if line:
        return dict(json.loads(line))
    code = rank.wait(10)  # its stdout ended: it is exiting
    if code is None:
        raise AssertionError(f"a rank said nothing in {RANK_SECONDS}s")
    err.seek(0)
    return {"exit": code, "stderr": err.read()[-3000:]}


def _stop(ranks: Sequence[Rank]) -> None:
    """Close every rank's stdin (each then ends its serving), then kill the ones still up."""
    for rank in ranks:
        rank.close_stdin()
    for rank in ranks:
        if rank.wait(30) is None:
            rank.kill()
            rank.wait(10)
        rank.close()


def rendezvous_store(timeout: timedelta) -> Any:
    """The ranks' rendezvous store (a `torch.distributed.TCPStore`), served from the test's
    process on a loopback port the kernel gave it (`.port`: the ranks' `MASTER_PORT`); it
    serves while the caller keeps it. Not a port picked free for rank 0 to bind later: one
    was once taken by then, and the other ranks timed out connecting to it."""
    import torch.distributed as dist

    return dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timeout
    )


def join_group(timeout: timedelta) -> tuple[int, int]:
    """Join the gloo group of this process's environment (`RANK`, `WORLD_SIZE`, and the
    test's `rendezvous_store` at `MASTER_ADDR`:`MASTER_PORT`); this rank and the world."""
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(  # type: ignore[attr-defined]
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
        timeout=timeout,
    )  # fmt: skip
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    return rank, world


@contextmanager
def rank_session() -> Iterator[tuple[int, int]]:
    """This process's (rank, world) in the gloo group of its environment, left at the end."""
    import torch.distributed as dist

    rank, world = join_group(GROUP_TIMEOUT)
    try:
        yield rank, world
    finally:
        dist.destroy_process_group()


leave = exit_now  # a rank process ends so once main() returned (group left, hub closed)


def say_and_serve(said: Mapping[str, Any]) -> None:
    """Print `said` as the rank's one JSON line, then serve until the test closes stdin."""
    print(json.dumps(said), flush=True)
    sys.stdin.read()
