"""A group call's manifest checks in processes of their own, beside the replica's event loop.

A `PublishShards` call of 4,096 shards, each with a 200-tensor manifest, is 819,200 tensor
entries to check (`ros.manifest_check.check_manifest_bytes`: about 80-120 us a shard, most of
it a Python loop over the entries), and with the GIL every thread of the replica takes its
turn at one core: checked on the loop (or in a worker thread) that is about half the
replica's CPU over the call, and the call's wall time with it. A process of its own checks
them on another core while the loop reads and checks the rest of each shard.

The process only says whether each manifest passes. The replica then stages those that
passed; one that did not is checked again where its shard is staged, as if no process had
looked, which raises the refusal its own `Publish` would (the same error, the same
message), so a refused shard is refused exactly as before, and nothing of it is written. A
replica without these processes (`processes` 0), or whose process died, checks every
manifest itself, as before.

The processes are forked from the process's one fork server (`tensorhub.fork_server`),
never from the replica itself (its gRPC threads), and started before the replica serves
(`start`: the fork server's start and its imports take a second or so of CPU, which would
otherwise slow the replica's first calls). Each ends when the replica's process does, even
one killed with SIGKILL that cannot stop them (`tensorhub.fork_server.exit_with`).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool

from ros.manifest_check import check_manifest_bytes
from tensorhub.errors import TensorHubError
from tensorhub.fork_server import exit_with, fork_context

ManifestCheck = tuple[
    bytes, str, str, int
]  # a manifest's bytes, its name in a refusal, model, version

log = logging.getLogger(__name__)

START_SECONDS = 60.0  # the most `start` waits for the processes before the replica checks alone


def passes(checks: Sequence[ManifestCheck]) -> list[bool]:
    """Whether each manifest of `checks` passes every rule (`check_manifest_bytes`), in order
    (run in a checking process)."""
    out: list[bool] = []
    for manifest, what, model, version in checks:
        try:
            check_manifest_bytes(manifest, what, model=model, version=version)
        except TensorHubError:
            out.append(False)
        else:
            out.append(True)
    return out


class ManifestProcesses:
    """`processes` checking processes (0: none), shared by a replica's group calls."""

    def __init__(self, processes: int) -> None:
        self._pool: ProcessPoolExecutor | None = None
        self.answered = 0  # manifests a process decided (for tests and metrics)
        if processes > 0:
            self._pool = ProcessPoolExecutor(  # each ends with the replica's process
                processes, mp_context=fork_context("ros.manifest_check"),
                initializer=exit_with, initargs=(os.getpid(),),
            )  # fmt: skip

    def start(self, timeout: float = START_SECONDS) -> None:
        """Start the processes and wait until one has answered (the first submit starts
        them); if none answers within `timeout`, the replica checks manifests itself."""
        pool = self._pool
        if pool is None:
            return
        try:
            pool.submit(passes, []).result(timeout)
        except (BrokenProcessPool, RuntimeError, FutureTimeout, OSError) as exc:
            log.warning("manifest checking processes did not start (%s): the replica checks", exc)
            self.close()

    @property
    def active(self) -> bool:
        """Whether manifests are checked in the processes (else by their callers)."""
        return self._pool is not None

    async def passes(self, checks: Sequence[ManifestCheck]) -> list[bool] | None:
        """Whether each manifest of `checks` passes, decided in a checking process; None
        when there is none (or it died: the caller checks them itself from then on)."""
        pool = self._pool
        if pool is None or not checks:
            return None
        try:
            verdicts = await asyncio.wrap_future(pool.submit(passes, list(checks)))
        except (BrokenProcessPool, RuntimeError) as exc:  # died, or shut down
            log.warning("manifest checking process gone (%s): the replica checks them", exc)
            self._pool = None
            return None
        self.answered += len(verdicts)
        return verdicts

    def close(self) -> None:
        """Stop the processes (a check waiting for them is cancelled: the replica stops)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
