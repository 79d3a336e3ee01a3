"""The directory a fetch writes: built aside, renamed into place when complete.

`tensorhub fetch -o DIR` never writes into DIR. It fills a hidden sibling,
`.DIR.tensorhub-partial-PID-XXXX`, and renames it to DIR after every file is written and
synced, so DIR either does not exist or is complete: a fetch that fails, is interrupted or
is killed leaves no directory that looks like a fetched model. A failure or Ctrl-C removes
the partial directory; one left by a killed fetch (SIGKILL, a crash, a reboot) is removed by
the next fetch into the same DIR once its process is gone.

DIR that exists is refused (`AlreadyExists`) unless `--force`, and even then only a
directory an earlier fetch wrote (it has `tensorhub.json`) or an empty one is replaced, so a
mistyped `-o ~ --force` deletes nothing. The old directory is moved aside first and removed
after the new one is in place.

A full disk is `DiskFull` (ENOSPC, EDQUOT), both when the free space is known to be too
small before anything is fetched and when a write fails, and the partial directory is
removed in both cases.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType

from tensorhub.errors import AlreadyExists, DiskFull, InvalidArgument

log = logging.getLogger(__name__)

RECORD = "tensorhub.json"  # written last into every fetched directory
_PARTIAL = ".tensorhub-partial-"
_OLD = ".tensorhub-old-"
_FULL = (errno.ENOSPC, errno.EDQUOT)


def partial_dirs(target: Path) -> list[Path]:
    """The partial directories of fetches into `target` (of live or dead processes)."""
    return sorted(target.parent.glob(f".{target.name}{_PARTIAL}*"))


def _owner_alive(partial: Path) -> bool:
    pid = partial.name.rsplit(_PARTIAL, 1)[-1].split("-", 1)[0]
    if not pid.isdigit():
        return True  # not ours to judge
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged writer may still use on the file system of `path`."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


@contextlib.contextmanager
def disk_errors(what: str) -> Iterator[None]:
    """Turn a full disk (ENOSPC, EDQUOT) while doing `what` into `DiskFull`."""
    try:
        yield
    except OSError as exc:
        if exc.errno in _FULL:
            raise DiskFull(f"{what}: {os.strerror(exc.errno or errno.ENOSPC)}") from None
        raise


class Output:
    """A fetch's output: `prepare()` before the hub is asked anything, then files written
    under `path`, then `commit()`. Used as a context manager, any exception (Ctrl-C
    included) removes the partial directory."""

    def __init__(self, target: Path, *, force: bool = False) -> None:
        self.target = target.absolute()
        self.force = force
        self.path = self.target.parent / (
            f".{self.target.name}{_PARTIAL}{os.getpid()}-{secrets.token_hex(3)}"
        )
        self._made = False

    def prepare(self) -> Path:
        """Refuse an existing target (without --force), make the parent and the partial
        directory, remove partial directories of dead fetches; `InvalidArgument` for a path
        that cannot be written."""
        self._check_target()
        try:
            self.target.parent.mkdir(parents=True, exist_ok=True)
            for stale in partial_dirs(self.target):
                if not _owner_alive(stale):
                    log.info("removing %s, left by a fetch that did not finish", stale)
                    shutil.rmtree(stale, ignore_errors=True)
            self.path.mkdir()
        except OSError as exc:
            if exc.errno in _FULL:
                raise DiskFull(f"cannot create {self.path}: {os.strerror(exc.errno)}") from None
            raise InvalidArgument(
                f"cannot write the output under {self.target.parent}: {exc.strerror or exc}"
            ) from None
        self._made = True
        return self.path

    def _check_target(self) -> None:
        if not (self.target.exists() or self.target.is_symlink()):
            return
        if not self.force:
            raise AlreadyExists(
                f"{self.target} exists: pass --force to replace it (nothing was changed)"
            )
        if not self.target.is_dir() or self.target.is_symlink():
            raise InvalidArgument(
                f"{self.target} is not a directory: not replaced, even with --force"
            )
        if not (self.target / RECORD).exists() and any(self.target.iterdir()):
            raise InvalidArgument(
                f"{self.target} was not written by tensorhub fetch (no {RECORD}) and is not "
                "empty: not replaced, even with --force"
            )

    def check_space(self, nbytes: int) -> None:
        """`DiskFull` now if the file system cannot take `nbytes` more."""
        free = free_bytes(self.path)
        if free < nbytes:
            raise DiskFull(
                f"{self.target.parent} has {free} bytes free, the fetch needs {nbytes}: "
                "nothing was fetched"
            )

    def commit(self) -> None:
        """Sync the partial directory and rename it to the target (replacing an older
        fetch's with --force)."""
        with disk_errors(f"syncing {self.path}"):
            _fsync_dir(self.path)
            old = None
            if self.target.exists():
                self._check_target()
                old = self.target.parent / f".{self.target.name}{_OLD}{os.getpid()}"
                self.target.rename(old)
            self.path.rename(self.target)
            self._made = False
            _fsync_dir(self.target.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def discard(self) -> None:
        """Remove the partial directory (nothing of it is left)."""
        if self._made:
            shutil.rmtree(self.path, ignore_errors=True)
            self._made = False

    def __enter__(self) -> Output:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is not None:
            self.discard()
            if isinstance(exc, DiskFull) and exc.args:
                exc.args = (f"{exc.args[0]}; the partial output was removed",)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
