"""Versions held in memory for serving: the holder side of the mutability contract.

A `HeldVersion` wraps one version's tensors (never copied) with its layout, a per-chunk
"present" bitmap (all set for a publisher, filled in as a reader receives — a PARTIAL
holder), per-chunk checksums, and an in-flight read counter so `release` can refuse new
reads and wait for running ones before the caller overwrites the memory.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from functools import partial

import torch
import xxhash

from tensorhub.errors import AlreadyExists, DeadlineExceeded, InvalidArgument, VersionUnavailable
from tensorhub.names import validate_name, validate_version
from transport.checksums import wsum64_of_segments
from transport.layout import Layout, Segment
from transport.staging import StagingBuffer

Key = tuple[str, str, int]  # (tenant, model, version)


def _byte_view(t: torch.Tensor) -> memoryview:
    """A writable byte memoryview over a contiguous CPU tensor's own storage (no copy)."""
    flat = t.detach().reshape(-1).view(torch.uint8)
    return flat.numpy().data.cast("B")


class HeldVersion:
    """One version's tensors, held for serving. Thread-safe.

    Tensors must be contiguous and all on one device; non-contiguous tensors are refused
    (`InvalidArgument`) rather than silently copied, so a publisher never doubles its
    memory behind the caller's back — pass `t.contiguous()` explicitly if needed.
    """

    def __init__(
        self,
        tenant: str,
        model: str,
        version: int,
        layout: Layout,
        tensors: Mapping[str, torch.Tensor],
        *,
        complete: bool,
    ) -> None:
        self.key: Key = (
            validate_name(tenant, "tenant"),
            validate_name(model, "model"),
            validate_version(version),
        )
        layout.check_tensors(tensors)
        self.layout = layout
        self.tensors = {s.name: tensors[s.name] for s in layout.tensors}
        devices = {t.device.type for t in self.tensors.values()}
        if len(devices) > 1 or not devices <= {"cpu", "cuda"}:
            raise InvalidArgument(f"tensors must all be on cpu or all on cuda, got {devices}")
        self.on_cuda = devices == {"cuda"}
        ordered = list(self.tensors.values())
        self._flats = [t.detach().reshape(-1).view(torch.uint8) for t in ordered]
        self._views = [] if self.on_cuda else [_byte_view(t) for t in ordered]
        n = layout.num_chunks
        self._segments: list[list[Segment] | None] = [None] * n
        self._present = bytearray([1 if complete else 0]) * n
        self._missing = 0 if complete else n
        self._checksums: list[int | None] = [None] * n
        self._cond = threading.Condition()
        self._inflight = 0
        self._released = False
        # The seqlock word of same-host readers that copy this memory themselves (CUDA IPC:
        # transport.ipc): even while the bytes are the advertised ones, odd from the moment
        # a release may let the caller change them. A reader keeps what it copied only if
        # the epoch it was granted is the one the holder reports after its copy.
        self._epoch = 0

    @classmethod
    def publisher(
        cls,
        tenant: str,
        model: str,
        version: int,
        tensors: Mapping[str, torch.Tensor],
        layout: Layout | None = None,
    ) -> HeldVersion:
        """A COMPLETE holder over a publisher's own tensors (the first source)."""
        return cls(
            tenant, model, version, layout or Layout.from_tensors(tensors), tensors, complete=True
        )

    @classmethod
    def reader(
        cls,
        tenant: str,
        model: str,
        version: int,
        layout: Layout,
        tensors: Mapping[str, torch.Tensor],
    ) -> HeldVersion:
        """A PARTIAL holder whose chunks `fetch` fills in; checks tensors before any write."""
        return cls(tenant, model, version, layout, tensors, complete=False)

    # -- chunk state -------------------------------------------------------------------

    @property
    def complete(self) -> bool:
        return self._missing == 0

    @property
    def released(self) -> bool:
        return self._released

    @property
    def reads_in_flight(self) -> int:
        return self._inflight

    @property
    def epoch(self) -> int:
        """0 while the memory holds the advertised bytes; 1 once a release has returned or
        given up waiting (the caller may change the memory from then on)."""
        return self._epoch

    def missing(self) -> list[int]:
        """Indices of chunks not received yet."""
        with self._cond:
            return [i for i, p in enumerate(self._present) if not p]

    def is_present(self, index: int) -> bool:
        return bool(self._present[index])

    def wait_present(self, index: int, timeout: float) -> bool:
        """Wait up to `timeout` s for chunk `index`; False if absent or released by then."""
        end = time.monotonic() + timeout
        with self._cond:
            while not self._present[index] and not self._released:
                left = end - time.monotonic()
                if left <= 0 or not self._cond.wait(left):
                    break
            return bool(self._present[index]) and not self._released

    def mark_present(self, index: int, checksum: int | None) -> None:
        """Record chunk `index` as received and verified; wakes holders waiting on it.
        `checksum` is its xxh3-64 (None: not known yet, computed when first served)."""
        with self._cond:
            if not self._present[index]:
                self._present[index] = 1
                self._missing -= 1
            self._checksums[index] = checksum
            self._cond.notify_all()

    @property
    def flats(self) -> list[torch.Tensor]:
        """One flat uint8 view per layout tensor over its own memory (any device): what a
        same-host reader copies into (transport.ipc)."""
        return self._flats

    def segments(self, index: int) -> list[Segment]:
        segs = self._segments[index]
        if segs is None:
            segs = self._segments[index] = self.layout.segments(index)
        return segs

    # -- bytes ---------------------------------------------------------------------------

    def source_views(
        self, index: int, staging: StagingBuffer | None = None, *, then: int | None = None
    ) -> list[memoryview]:
        """The payload of chunk `index`: views over the tensors' own memory, or, through
        `staging` (required for CUDA), its copy in one of staging's host buffers, valid
        until the next call on `staging`. `then`, the chunk to be asked for next, starts
        gathering into staging's other buffer before this call waits for its own copy, so
        that copy overlaps the send of this chunk (a PARTIAL holder passes only a chunk it
        has). The caller drains `staging` (`StagingBuffer.drain`) before a read ends."""
        if staging is None:
            if self.on_cuda:
                raise InvalidArgument("a CUDA-resident version needs a staging buffer")
            segs = self.segments(index)
            return [self._views[s.tensor][s.start : s.start + s.length] for s in segs]
        ahead = None if then is None else ((id(self), then), partial(self._parts, then))
        return [staging.gather((id(self), index), partial(self._parts, index), ahead)]

    def _parts(self, index: int) -> list[torch.Tensor]:
        """Chunk `index`'s segments as flat uint8 tensors over the tensors (any device)."""
        return [self._flats[s.tensor][s.start : s.start + s.length] for s in self.segments(index)]

    def chunk_parts(self, index: int) -> list[torch.Tensor]:
        """Chunk `index`'s segments as flat uint8 tensors over the tensors' own memory (any
        device, no copy): what a delta is encoded from and applied to (`transport.delta`)."""
        return self._parts(index)

    def sink_views(self, index: int, staging: StagingBuffer | None = None) -> list[memoryview]:
        """Where to receive chunk `index`: the tensors' own memory, or a free host buffer of
        `staging` (required for CUDA), whose earlier copy has completed."""
        if staging is None:
            if self.on_cuda:
                raise InvalidArgument("a CUDA-resident version needs a staging buffer")
            return self.source_views(index)
        return [staging.sink(self.layout.payload_bytes(index))]

    def commit(self, index: int, checksum: int, staging: StagingBuffer | None = None) -> None:
        """Make a received, verified chunk visible. Received through `staging`: its copy to
        the tensors is started, and the chunk is marked present only once that copy
        completed (`staging.settled()` / `flush()` say when), never before: a holder must
        not serve bytes that are not in its memory yet."""
        if staging is None:
            self.mark_present(index, checksum)
            return
        # A chunk present already (received twice) is served: its memory is not rewritten.
        parts = [] if self.is_present(index) else self._parts(index)
        staging.scatter(parts, index, partial(self.mark_present, index, checksum))

    def checksum(self, index: int, staging: StagingBuffer | None = None) -> int:
        """xxh3-64 of chunk `index`'s payload; computed once, then cached (the memory of an
        advertised version does not change — the mutability contract)."""
        cached = self._checksums[index]
        if cached is None:
            h = xxhash.xxh3_64()
            for view in self.source_views(index, staging):
                h.update(view)
            cached = self._checksums[index] = int(h.intdigest())
        return cached

    def wsum64(self, index: int) -> int:
        """wsum64 of chunk `index` (`transport.checksums`), computed where the tensors are:
        for a version in GPU memory, kernels on the device and 8 bytes back, no host copy."""
        return wsum64_of_segments(self._flats, self.segments(index))

    def precompute_checksums(self) -> None:
        """Compute every present chunk's checksum now (e.g. at publish), off the read path.
        CUDA: over the staged host bytes, each chunk's copy overlapping the previous hash."""
        todo = [
            i
            for i in range(self.layout.num_chunks)
            if self._present[i] and self._checksums[i] is None
        ]
        if not self.on_cuda:
            for i in todo:
                self.checksum(i)
            return
        staging = StagingBuffer.for_tensors(self.layout.chunk_size, self.tensors.values())
        try:
            for i, then in zip(todo, [*todo[1:], None], strict=True):
                self.source_views(i, staging, then=then)  # stage i, start gathering `then`
                self.checksum(i, staging)  # over i's staged bytes
        finally:
            staging.drain()

    # -- reads in flight and release -----------------------------------------------------

    @contextmanager
    def reading(self) -> Iterator[None]:
        """Count one read in flight; refused with `VersionUnavailable` once released."""
        with self._cond:
            if self._released:
                raise VersionUnavailable(f"{self.key} is released on this holder")
            self._inflight += 1
        try:
            yield
        finally:
            with self._cond:
                self._inflight -= 1
                self._cond.notify_all()

    def release(self, timeout: float) -> None:
        """Refuse new reads, then wait up to `timeout` s for reads in flight to finish.
        Raises `DeadlineExceeded` if they do not (the version stays refused). Either way the
        epoch turns odd on the way out: a same-host reader whose copy was still running
        learns the memory may have changed under it, and drops what it copied."""
        end = time.monotonic() + timeout
        with self._cond:
            self._released = True
            self._cond.notify_all()
            try:
                while self._inflight:
                    left = end - time.monotonic()
                    if left <= 0:
                        raise DeadlineExceeded(
                            f"{self._inflight} read(s) of {self.key} still in flight after "
                            f"{timeout}s"
                        )
                    self._cond.wait(left)
            finally:
                self._epoch |= 1


Watcher = Callable[["HeldVersion"], None]
"""Told of one held version (`HolderStore.watch`)."""


class HolderStore:
    """The versions this process serves, by (tenant, model, version). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[Key, HeldVersion] = {}
        self._watchers: list[tuple[Watcher, Watcher]] = []

    def watch(self, added: Watcher, released: Watcher) -> None:
        """Tell `added` of every version served from now on (and at once of those held
        now), and `released` of each once its release returned or gave up waiting: how
        a holder backend registers and deregisters the memory (`transport.backend`)."""
        with self._lock:
            self._watchers.append((added, released))
            held = list(self._held.values())
        for h in held:
            added(h)

    def _added(self, held: HeldVersion) -> None:
        for added, _ in list(self._watchers):
            added(held)

    def _released(self, held: HeldVersion) -> None:
        for _, released in list(self._watchers):
            released(held)

    def add(self, held: HeldVersion) -> None:
        with self._lock:
            if held.key in self._held:
                raise AlreadyExists(f"{held.key} is already held")
            self._held[held.key] = held
        self._added(held)

    def get(self, key: Key) -> HeldVersion | None:
        with self._lock:
            return self._held.get(key)

    def keys(self) -> list[Key]:
        with self._lock:
            return list(self._held)

    def replace(self, held: HeldVersion, timeout: float) -> None:
        """Serve `held` in place of the version with the same key, with no gap in between,
        then release the old one (waiting up to `timeout` for its reads in flight)."""
        with self._lock:
            old = self._held.get(held.key)
            self._held[held.key] = held
        self._added(held)
        if old is not None and old is not held:
            try:
                old.release(timeout)
            finally:
                self._released(old)

    def release(self, key: Key, timeout: float) -> None:
        """Release `key` (see `HeldVersion.release`), then forget it: the version is free."""
        held = self.get(key)
        if held is None:
            return
        try:
            held.release(timeout)
        finally:
            self._released(held)
        with self._lock:
            if self._held.get(key) is held:
                del self._held[key]
