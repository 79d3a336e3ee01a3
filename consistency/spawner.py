"""Start child processes that end with the process that started them, even on SIGKILL.

An embedded etcd member is a Go binary that cannot be asked to watch its parent, so the
kernel does it: Linux's parent-death signal (`prctl(PR_SET_PDEATHSIG)`), which util-linux's
`setpriv` sets between its fork and its exec of the real program (`parent_bound`). The
signal survives exec (etcd is not set-user-ID) and every exec keeps the pid, so the `Popen`
is the program itself: signals, `poll()` and `wait()` reach it as before.

Two properties of that signal shape this module:

- The kernel sends it when the *thread* that forked the child ends, not the process. So a
  `Spawner` forks every child on one daemon thread of its own, which lives until `close`:
  a short-lived caller thread (a chaos thread that restarts a member) ends without taking
  its child along. A daemon thread rather than an executor's worker: the interpreter joins
  executor workers before `atexit` handlers run, which would SIGKILL the children before
  a cleanup could stop them with SIGTERM.
- A parent killed between the fork and `setpriv`'s prctl would leave the child without
  it. So `setpriv` runs `/bin/sh`, which goes on (exec again, same pid) only while its
  parent is still the process that spawned it: a parent that dies once the signal is set
  is signalled, one that died before is seen by the check.

Where `setpriv` or its parent-death option (util-linux 2.33+) is missing, or off Linux,
children start plainly and a warning is logged once: there they outlive a killed parent.
"""

from __future__ import annotations

import functools
import logging
import os
import queue
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TypeVar

__all__ = ["Spawner", "parent_bound", "parent_death_signal_available"]

_LOG = logging.getLogger(__name__)
_T = TypeVar("_T")
_SH = "/bin/sh"
# $0 is the pid of the process that spawned it; "$@" the program and its arguments.
_PARENT_CHECK = '[ "$PPID" = "$0" ] || exit 111; exec "$@"'
START_S = 60.0
"""The most `Spawner.call` waits for one start: a fork and an exec take milliseconds, so
only a stopped or starved process takes this long."""


def parent_bound(argv: Sequence[str]) -> list[str]:
    """`argv` wrapped so that the program gets SIGKILL when the thread that forks it ends
    (see the module docstring); `argv` unchanged where that is not available. Call it in
    the process that forks the child: the parent check names this process's pid."""
    setpriv = _setpriv()
    if setpriv is None:
        return list(argv)
    prefix = [setpriv, "--pdeathsig", "KILL", "--"]
    if os.access(_SH, os.X_OK):
        prefix += [_SH, "-c", _PARENT_CHECK, str(os.getpid())]
    return [*prefix, *argv]


def parent_death_signal_available() -> bool:
    """Whether `parent_bound` binds children to their parent here (else it warned once)."""
    return _setpriv() is not None


@functools.cache
def _setpriv() -> str | None:
    """Path of a `setpriv` that can set the parent-death signal, or None (warned once)."""
    path = shutil.which("setpriv")
    if not sys.platform.startswith("linux"):
        why = f"{sys.platform} has no parent-death signal"
    elif path is None:
        why = "no setpriv on PATH (util-linux)"
    else:
        try:
            usage = subprocess.run(
                [path, "--help"], capture_output=True, text=True, timeout=10, check=False
            ).stdout
            why = f"{path} cannot set the parent-death signal (util-linux 2.33+ can)"
        except (OSError, subprocess.TimeoutExpired) as exc:
            usage, why = "", f"{path} --help failed ({exc})"
        if "--pdeathsig" in usage:
            return path
    _LOG.warning(
        "%s: embedded etcd members will outlive this process if it is killed outright", why
    )
    return None


class Spawner:
    """Runs every child start (`call`) on one daemon thread of its own, so that each child's
    parent-death signal is tied to that thread, not to whichever thread asked. The thread
    starts with the first `call` (again after `close`, and anew in a forked process, which
    has no copy of it) and ends at `close`: call that once every child has been stopped,
    since the children still running then get SIGKILL."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._lock = threading.Lock()
        self._worker: _Worker | None = None

    def call(self, start: Callable[[], _T]) -> _T:
        """`start()` run on the spawner's thread (e.g. a `subprocess.Popen`); its result,
        or its exception raised here. Waits only for `start` itself (a `Popen` returns once
        the child has exec'd its program), and at most `START_S`: `TimeoutError` after."""
        with self._lock:
            worker = self._worker
            if worker is None or worker.pid != os.getpid():
                worker = self._worker = _Worker(self._name)
            future: Future[_T] = Future()
            worker.jobs.put(functools.partial(_run_into, start, future))
        return future.result(timeout=START_S)

    def close(self) -> None:
        """End the thread (bounded wait); children it started and still running get SIGKILL."""
        with self._lock:
            worker, self._worker = self._worker, None
        if worker is not None and worker.pid == os.getpid():
            worker.jobs.put(None)
            worker.thread.join(timeout=10.0)


class _Worker:
    """The spawner's thread of one process, and its queue of starts (None: end)."""

    def __init__(self, name: str) -> None:
        self.pid = os.getpid()
        self.jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            job()


def _run_into(start: Callable[[], _T], future: Future[_T]) -> None:
    """`start()` with its outcome handed to `future` (every exception: the caller's)."""
    try:
        future.set_result(start())
    except BaseException as exc:  # re-raised in the caller's thread
        future.set_exception(exc)
