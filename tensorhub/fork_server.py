"""The process's one fork server, shared by every caller that forks workers from it.

Workers that import torch cost about 1.5-4 s of CPU each to start (torch, the hub client,
transformers), and chaos runs and the tests' trainer ranks start many together on two cores.
A worker forked from a server that imported those modules once starts in milliseconds, and
is still a process of its own (its own pid, signals and exit code).

`multiprocessing` runs one fork server per process, and imports the modules named when it
starts, not later. So every caller names what its workers need here, in `fork_context`, and
a process that knows all its callers (the test suite's conftest) names them all before the
first worker starts: whichever caller starts the server, each finds its modules imported.
"""

from __future__ import annotations

import multiprocessing
import os
import select
import threading
from multiprocessing.context import ForkServerContext

_PRELOAD: list[str] = []


def fork_context(*preload: str) -> ForkServerContext:
    """The fork-server context, with `preload` added to the modules its server imports
    when it starts (no effect on a server already running: those workers import what they
    lack themselves, as a spawned process would)."""
    for module in preload:
        if module not in _PRELOAD:
            _PRELOAD.append(module)
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(_PRELOAD))
    return context


def exit_with(pid: int) -> None:
    """In a forked worker: exit as soon as process `pid` (the one it works for) has ended.

    A worker's parent is the fork server, not its caller, and a pool's worker holds both
    ends of its own task pipe, so it never sees its caller go: a caller killed with SIGKILL
    would leave its idle workers, and the fork server they keep alive, running for good.
    A daemon thread waits on a pidfd of `pid` (readable once it has exited; `pid` is
    alive when a pool starts its workers, so the pidfd names that process and no later one
    with its number) and ends the worker then. Meant as a pool's `initializer`."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:  # already gone
        os._exit(0)

    def wait() -> None:
        select.select([fd], [], [])
        os._exit(0)

    threading.Thread(target=wait, name=f"exit-with-{pid}", daemon=True).start()
