"""Filling a fetch's output files from the hub, in bounded memory or as a holder.

Two ways, one file layout (`ros.cli.outplan`):

- `stream_fill` (plain `fetch`): batch after batch of pieces, each read with the SDK's
  `fetch_slices` (only the chunks that hold them, checked against the publisher's
  checksums) and appended to its file while the next batch is fetched. The memory used
  stays within three batch budgets whatever the model's size. Whole and model-parallel
  versions alike: for the latter each piece is assembled from the shards' blocks
  (resharded into full tensors). The version is pinned for the whole fetch (`pinned`), so
  retention cannot remove it between two batches.
- `mapped_fill` (`fetch --serve`): the files are made at their final size and mapped, and
  the SDK's `fetch` writes straight into the mapping, so this process becomes a holder and
  serves the version from the files' pages afterwards. Its memory is then the model's size
  in page cache (that is what holding a version takes).

Both compute each file's SHA-256 for `tensorhub.json`, and turn a full disk into `DiskFull`.
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import secrets
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import torch

from ros.cli.outdir import disk_errors
from ros.cli.outplan import Batch, OutFile, Piece
from ros.cli.progress import Bar
from ros.cli.rss import give_back_freed
from ros.client.handles import Held
from ros.client.hub import Hub
from ros.client.orchestrator import Progress
from ros.client.slice import Slice
from tensorhub.errors import DeadlineExceeded, TensorHubError


@dataclass(frozen=True)
class Until:
    """The deadline of a whole command (`--deadline`): each call made under it gets what is
    left (`left()`), and none starts after it (`DeadlineExceeded`)."""

    what: str
    end: float

    @classmethod
    def after(cls, seconds: float, what: str) -> Until:
        return cls(what, time.monotonic() + seconds)

    def left(self) -> float:
        remaining = self.end - time.monotonic()
        if remaining <= 0.05:
            raise DeadlineExceeded(f"{self.what}: the deadline passed")
        return remaining


@dataclass
class Written:
    """What a fill wrote: SHA-256 and size of every file, and the bytes read from holders."""

    sha256: dict[str, str] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)
    fetched: int = 0  # bytes of chunks received (a chunk two batches share counts twice)
    batches: int = 0


def _write(f: BinaryIO, data: memoryview) -> None:
    """Append `data` to `f`: every byte a fetch writes goes through here (and tests inject
    ENOSPC here)."""
    f.write(data)


def _bytes_of(t: torch.Tensor) -> memoryview:
    array = t.detach().reshape(-1).view(torch.uint8).numpy()
    return memoryview(array.data).cast("B")


def write_file(path: Path, data: bytes) -> None:
    """A small file of the output (index, carried file, record), written and synced."""
    with disk_errors(f"writing {path}"), open(path, "wb") as f:
        _write(f, memoryview(data))
        f.flush()
        os.fsync(f.fileno())


class Appender:
    """Writes `files` one after the other into `directory`: a file's header when it is
    opened, then the pieces appended in order; the previous file is synced and closed when
    the next one opens, so one file is open at a time."""

    def __init__(self, directory: Path, files: Sequence[OutFile]) -> None:
        self._directory = directory
        self._files = files
        self._hashes = [hashlib.sha256() for _ in files]
        self._current = -1
        self._f: BinaryIO | None = None

    def append(self, number: int, data: memoryview) -> None:
        self._to(number)
        assert self._f is not None
        if len(data):
            with disk_errors(f"writing {self._path(number)}"):
                _write(self._f, data)
            self._hashes[number].update(data)

    def finish(self, written: Written) -> None:
        """Write the files no piece reached (empty tensors only), sync and close the last."""
        self._to(len(self._files) - 1)
        self._close(sync=True)
        for number, out in enumerate(self._files):
            written.sha256[out.name] = self._hashes[number].hexdigest()
            written.sizes[out.name] = out.nbytes

    def close(self) -> None:
        self._close(sync=False)

    def _path(self, number: int) -> Path:
        return self._directory / self._files[number].name

    def _to(self, number: int) -> None:
        while self._current < number:
            self._close(sync=True)
            self._current += 1
            header = self._files[self._current].header
            path = self._path(self._current)
            with disk_errors(f"writing {path}"):
                self._f = open(path, "wb")  # noqa: SIM115  (closed by _close)
                _write(self._f, memoryview(header))
            self._hashes[self._current].update(header)

    def _close(self, *, sync: bool) -> None:
        if self._f is None:
            return
        f, self._f = self._f, None
        try:
            if sync:
                with disk_errors(f"writing {f.name!s}"):
                    f.flush()
                    os.fsync(f.fileno())
        finally:
            f.close()


@contextmanager
def pinned(hub: Hub, model: str, version: int, timeout: float) -> Iterator[None]:
    """Keep `model@version` from being retired while a fetch reads it in many calls.

    The same Pin and Unpin the SDK's `fetch_slices` makes around each call, made once around
    all of them, under this client's session (so the pin goes if the process dies); an unpin
    that fails is left to the session's end.
    """
    pin_id = f"cli-fetch-{secrets.token_hex(6)}"
    hub.pin(model, version, pin_id, timeout=timeout)
    try:
        yield
    finally:
        with contextlib.suppress(TensorHubError):
            hub.unpin(model, version, pin_id, timeout=timeout)


def stream_fill(
    hub: Hub,
    model: str,
    version: int,
    directory: Path,
    files: Sequence[OutFile],
    plan: Sequence[Batch],
    deadline: Until,
    bar: Bar,
) -> Written:
    """Fetch `plan`'s batches in order and append each piece to its file.

    Writing (and hashing, and syncing) a batch overlaps with fetching the next one, on one
    writer thread: the next batch is handed over only once the previous one is written, so
    at most three batches' worth of memory is in use (one being written, one being fetched
    and its staged chunks), and a write error stops the fetch at the next batch."""
    written = Written()
    out = Appender(directory, files)
    try:
        with ThreadPoolExecutor(1, thread_name_prefix="fetch-writer") as writer:
            pending: Future[None] | None = None
            try:
                for batch in plan:
                    fetched = _fetch_batch(hub, model, version, batch, deadline, bar, written)
                    if pending is not None:
                        pending.result()  # the previous batch is written (or its error)
                    pending = writer.submit(_append_all, out, fetched)
                    del fetched
                if pending is not None:
                    pending.result()
            finally:
                if pending is not None:
                    pending.cancel()
        out.finish(written)
    finally:
        out.close()
    return written


def _fetch_batch(
    hub: Hub,
    model: str,
    version: int,
    batch: Batch,
    deadline: Until,
    bar: Bar,
    written: Written,
) -> list[tuple[Piece, torch.Tensor]]:
    """One `fetch_slices` call: the batch's pieces, read into fresh tensors."""
    tensors = [(p, torch.empty(p.box.shape, dtype=p.spec.dtype)) for p in batch.pieces]
    slices = {p.spec.name: Slice(t, p.box.offsets, p.spec.shape) for p, t in tensors if p.nbytes}
    start = bar.n
    if slices:

        def moved(progress: Progress) -> None:
            bar.reach(start + min(batch.nbytes, progress.bytes))

        got = hub.fetch_slices(
            model, version, slices=slices, timeout=deadline.left(), progress=moved
        )
        written.fetched += got.total_bytes
        written.batches += 1
        give_back_freed()  # the call's staged chunks, freed as it returned
    bar.reach(start + batch.nbytes)
    return tensors


def _append_all(out: Appender, fetched: list[tuple[Piece, torch.Tensor]]) -> None:
    """Write a batch, then free it and give its memory back (`give_back_freed`)."""
    for piece, tensor in fetched:
        out.append(piece.file, _bytes_of(tensor) if piece.nbytes else memoryview(b""))
    fetched.clear()
    give_back_freed()


@dataclass
class Mapped:
    """The files of a `--serve` fetch, mapped: the held version is served from them."""

    held: Held
    maps: list[mmap.mmap]

    def close(self) -> None:
        """After the version is released: unmap (views of the maps go with `held`)."""
        self.held.tensors.clear()
        for m in self.maps:
            with contextlib.suppress(BufferError):  # a view still exported: it goes at exit
                m.close()


def mapped_fill(
    hub: Hub,
    model: str,
    version: int,
    directory: Path,
    files: Sequence[OutFile],
    deadline: Until,
    bar: Bar,
) -> tuple[Mapped, Written]:
    """Make the files at their final size, map them, and fetch the version into the
    mapping (this client then holds it and serves it from the files)."""
    maps: list[mmap.mmap] = []
    views: dict[str, torch.Tensor] = {}
    for out in files:
        path = directory / out.name
        with disk_errors(f"writing {path}"), open(path, "w+b") as f:
            _write(f, memoryview(out.header))
            os.posix_fallocate(f.fileno(), 0, out.nbytes)  # ENOSPC now, not SIGBUS later
            mapped = mmap.mmap(f.fileno(), out.nbytes, mmap.MAP_SHARED)
        maps.append(mapped)
        for spec in out.specs:
            at = out.offsets()[spec.name]
            count = spec.nbytes // spec.dtype.itemsize
            if count:
                flat = torch.frombuffer(mapped, dtype=spec.dtype, count=count, offset=at)
                views[spec.name] = flat.reshape(spec.shape)
            else:
                views[spec.name] = torch.empty(spec.shape, dtype=spec.dtype)

    def moved(progress: Progress) -> None:
        bar.reach(progress.fraction * bar_total)

    bar_total = sum(s.nbytes for out in files for s in out.specs)
    held = hub.fetch(model, version, into=views, timeout=deadline.left(), progress=moved)
    bar.reach(bar_total)
    written = Written(fetched=sum(held.stats.bytes_per_source.values()), batches=1)
    for out, mapped in zip(files, maps, strict=True):
        with disk_errors(f"writing {directory / out.name}"):
            mapped.flush()
        written.sha256[out.name] = hashlib.sha256(mapped).hexdigest()
        written.sizes[out.name] = out.nbytes
    return Mapped(held, maps), written
