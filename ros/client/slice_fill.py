"""A first reader of a block set serves each chunk of it as soon as that chunk's own bytes
are in place (`ros.client.slice_layout`, a reader in a layout: docs/design-notes.md, "Readers in
another layout").

The first reader reads its blocks from the trainer's shards into staging copies of the
shards' layouts. `Fill` copies each trainer chunk's part of the blocks out of its staging
copy the moment that chunk is verified (marked present: `FillStaging`), and counts, per
chunk of the block set's layout still missing, the bytes still to be written into it from
the trainer; a chunk whose count reaches zero is marked present (`HeldVersion.mark_present`,
its xxh3-64 computed then, over those bytes) and served from then on, whatever the rest of
its blocks. Every element of a block read from the trainer lies in exactly one source
shard's part (`slice_plan.plan_copies`) and in exactly one chunk of that shard, so it is
written once and counted once; a chunk is marked only when every byte of it came from
verified trainer chunks, and nothing writes to it after that but bytes equal to those (a
block that a peer left torn is written whole, over chunks present already with the same,
verified, bytes).

Geometry: a trainer chunk holds a flat byte range of each tensor it touches (elements never
straddle chunks: tensors start on `transport.layout.ALIGN` and chunk sizes are multiples of
it). A flat range of a row-major block is a few boxes (`flat_boxes`: at most two per
dimension and one), each box's intersection with the part to copy is one strided copy, and
the elements of a box below a flat index are counted in one pass over its dimensions
(`count_below`), so a chunk costs a handful of copies and counts, not a pass per element.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import count
from typing import Protocol

import torch

from tensorhub.errors import IntegrityError, TensorHubError
from transport.boxes import Box, byte_span, chunks_for
from transport.layout import Layout, torch_dtype
from transport.store import HeldVersion

log = logging.getLogger(__name__)


def flat_boxes(shape: tuple[int, ...], lo: int, hi: int) -> list[Box]:
    """Boxes (local coordinates of a row-major array of `shape`) that cover exactly its
    flat elements `[lo, hi)`, in flat order: a partial row, whole rows, a partial row, per
    dimension."""
    if hi <= lo or math.prod(shape) == 0:
        return []
    if not shape:
        return [Box((), ())]
    inner = math.prod(shape[1:])
    first, last = lo // inner, (hi - 1) // inner
    rest = shape[1:]

    def row(r: int, a: int, b: int) -> list[Box]:
        return [Box((r, *x.offsets), (1, *x.shape)) for x in flat_boxes(rest, a, b)]

    if first == last:
        return row(first, lo - first * inner, hi - first * inner)
    out: list[Box] = []
    start = first
    if lo % inner:
        out += row(first, lo % inner, inner)
        start = first + 1
    end = hi // inner
    if end > start:
        out.append(Box((start, *(0,) * len(rest)), (end - start, *rest)))
    if hi % inner:
        out += row(end, 0, hi % inner)
    return out


def count_below(box: Box, shape: tuple[int, ...], x: int) -> int:
    """How many elements of `box` (local coordinates of a row-major array of `shape`) have
    a flat index below `x`."""
    if box.volume == 0 or x <= 0:
        return 0
    if not shape:
        return 1
    inner = math.prod(shape[1:])
    row, within = divmod(x, inner)
    o, s = box.offsets[0], box.shape[0]
    rows = min(max(row, o), o + s) - o
    count = rows * math.prod(box.shape[1:])
    if o <= row < o + s:
        count += count_below(Box(box.offsets[1:], box.shape[1:]), shape[1:], within)
    return count


def _shift(box: Box, by: Sequence[int]) -> Box:
    return Box(tuple(o + d for o, d in zip(box.offsets, by, strict=True)), box.shape)


def _index(box: Box) -> tuple[slice, ...]:
    """`box` (local coordinates) as an index into the array it is local to."""
    return tuple(slice(o, o + s) for o, s in zip(box.offsets, box.shape, strict=True))


class Part(Protocol):
    """One block's part that one source shard gives: `source`, the box the shard holds of
    the global tensor `name`, and `part`, the intersection to copy (global coordinates)."""

    @property
    def name(self) -> str: ...

    @property
    def source(self) -> Box: ...

    @property
    def part(self) -> Box: ...


class Fill:
    """The chunks of a first reader's block set (`dest`) still missing and the bytes each
    still awaits from the trainer's shards, for the blocks `todo` read from them (`boxes`:
    by name, the box of the global tensor each holds). Thread-safe: staging copies of
    several shards, read by several connections each, report chunks at once."""

    def __init__(
        self,
        dest: HeldVersion,
        boxes: Mapping[str, Box],
        todo: Iterable[str],
        publisher: Sequence[int] | None = None,
    ) -> None:
        self._dest = dest
        # the publisher's wsum64 of every chunk of `dest` (a layout declared before the
        # publish): each chunk is checked against it before it is marked present, and the
        # trainer chunks may then be read in byte ranges (`ros.client.slice_ranges`)
        self.publisher = publisher
        self.failed: dict[int, str] = {}  # chunks of `dest` that failed that check: why
        self.notes: list[str] = []  # reads in byte ranges that fell back to whole chunks
        self._boxes = dict(boxes)
        self._specs = {spec.name: (i, spec) for i, spec in enumerate(dest.layout.tensors)}
        wanted = set(todo)
        self._left: dict[int, int] = {}
        for index in dest.missing():
            segs = dest.segments(index)
            need = sum(s.length for s in segs if dest.layout.tensors[s.tensor].name in wanted)
            if need:
                self._left[index] = need
        self._lock = threading.Lock()
        self._copied: set[tuple[int, int]] = set()  # (a staging copy's serial, its chunk)
        self._serials = count()
        self._error: BaseException | None = None

    def staging(
        self, layout: Layout, tensors: Mapping[str, torch.Tensor], parts: Sequence[Part]
    ) -> FillStaging:
        """A staging copy of a source shard's `layout` over `tensors` (of `dest`'s version)
        whose chunks, each as it is marked present (verified), have their `parts` copied
        out into `dest`."""
        tenant, model, version = self._dest.key
        with self._lock:
            serial = next(self._serials)
        staging = FillStaging(tenant, model, version, layout, tensors, serial)
        # the hook is handed the staging copy: a closure over it would be a reference cycle,
        # and its tensors would outlive the read until the cyclic collector ran
        staging.on_present = lambda held, index: self.arrived(held, index, parts)
        return staging

    def arrived(self, staging: FillStaging, index: int, parts: Sequence[Part]) -> None:
        """Chunk `index` of `staging` is verified: copy what `parts` take of it into `dest`
        and mark present every chunk of `dest` that has all its bytes now. Once per chunk of
        a staging copy; a failure is kept for `finish` (this runs in a transport thread)."""
        with self._lock:
            if (staging.serial, index) in self._copied or self._error is not None:
                return
            self._copied.add((staging.serial, index))
            try:
                self._copy(staging, index, parts)
            except BaseException as exc:  # the read then fails with it (`finish`)
                self._error = exc

    def finish(self, staging: FillStaging, needed: Iterable[int], parts: Sequence[Part]) -> None:
        """After a staging copy's read returned: copy out any of its `needed` chunks not
        copied yet (present, but reported by no hook), and raise what a copy raised."""
        staging.on_present = None
        for index in sorted(needed):
            if staging.is_present(index):
                self.arrived(staging, index, parts)
        with self._lock:
            if self._error is not None:
                raise self._error

    def _copy(self, staging: HeldVersion, index: int, parts: Sequence[Part]) -> None:
        by_name = {p.name: p for p in parts}
        layout = staging.layout
        filled: dict[int, int] = {}
        gpus = {t.device for t in staging.tensors.values() if t.is_cuda}
        for device in gpus:  # the staging copy's bytes are in place, on any stream
            torch.cuda.synchronize(device)
        for seg in staging.segments(index):
            spec = layout.tensors[seg.tensor]
            part = by_name.get(spec.name)
            if part is None:
                continue
            size = torch_dtype(spec.dtype).itemsize
            src = staging.tensors[spec.name]
            out = self._dest.tensors[spec.name]
            block = self._boxes[spec.name]
            local_part = _shift(part.part, [-o for o in part.source.offsets])
            elements = flat_boxes(
                part.source.shape, seg.start // size, (seg.start + seg.length) // size
            )
            for piece in elements:
                common = piece.intersect(local_part)
                if common is None or common.volume == 0:
                    continue
                glob = _shift(common, part.source.offsets)
                into = _shift(glob, [-o for o in block.offsets])
                out[_index(into)].copy_(src[_index(common)])
                if out.is_cuda:
                    gpus.add(out.device)
                self._count(spec.name, into, block.shape, size, filled)
        for device in gpus:  # the copies are done before their chunks are served
            torch.cuda.synchronize(device)
        for at, nbytes in filled.items():
            left = self._left.get(at)
            if left is None:
                continue  # present already (a peer's verified bytes: the same ones)
            left -= nbytes
            if left < 0:
                raise TensorHubError(f"chunk {at} of the block set was written twice")
            if left:
                self._left[at] = left
                continue
            del self._left[at]
            if self.publisher is not None and self._dest.wsum64(at) != self.publisher[at]:
                self.failed[at] = f"chunk {at} of the block set differs from the publisher's"
                continue  # not served: its trainer chunks are read whole (`reverify`)
            self._dest.mark_present(at, None)
            if not self._dest.on_cuda:
                self._dest.checksum(at)

    def note(self, why: str) -> None:
        """Record (and log) why a read of byte ranges fell back to whole chunks."""
        log.warning("%s", why)
        with self._lock:
            self.notes.append(why)

    @property
    def layout(self) -> Layout:
        """The block set's layout (of `dest`)."""
        return self._dest.layout

    def unverified(self) -> set[int]:
        """The chunks of `dest` that failed the publisher's check so far."""
        with self._lock:
            return set(self.failed)

    def reverify(self) -> dict[int, str]:
        """After the blocks of the `failed` chunks were written again from whole trainer
        chunks: mark present each one that now has the publisher's wsum64; returns the
        failures (why each failed at first) and raises `IntegrityError` for a chunk that
        still differs (the whole chunks were checked against the manifest: the publisher's
        two checksums disagree)."""
        with self._lock:
            failed, self.failed = self.failed, {}
        sums = self.publisher if self.publisher is not None else ()
        for at in sorted(failed):
            if at >= len(sums) or self._dest.wsum64(at) != sums[at]:
                raise IntegrityError(
                    f"chunk {at} of the block set differs from the publisher's wsum64 after "
                    "its trainer chunks were read whole"
                )
            self._dest.mark_present(at, None)
            if not self._dest.on_cuda:
                self._dest.checksum(at)
        return failed

    def _count(
        self, name: str, into: Box, shape: tuple[int, ...], size: int, filled: dict[int, int]
    ) -> None:
        """Add the bytes `into` (a box of block `name`, of `shape`) wrote into each chunk of
        `dest` to `filled`."""
        tensor, spec = self._specs[name]
        first, end = byte_span(Box((0,) * len(shape), shape), into, size)
        for at in chunks_for(self._dest.layout, spec, first, end):
            for seg in self._dest.segments(at):
                if seg.tensor != tensor:
                    continue
                lo, hi = seg.start // size, (seg.start + seg.length) // size
                n = count_below(into, shape, hi) - count_below(into, shape, lo)
                if n:
                    filled[at] = filled.get(at, 0) + n * size


class FillStaging(HeldVersion):
    """A staging copy whose chunks, each as it is marked present (verified by the
    transport, or carried over from a step before), are told to `on_present`."""

    on_present: Callable[[FillStaging, int], None] | None = None

    def __init__(
        self,
        tenant: str,
        model: str,
        version: int,
        layout: Layout,
        tensors: Mapping[str, torch.Tensor],
        serial: int,
    ) -> None:
        super().__init__(tenant, model, version, layout, tensors, complete=False)
        self.serial = serial  # unique within its `Fill`

    def mark_present(self, index: int, checksum: int | None) -> None:
        super().mark_present(index, checksum)
        hook = self.on_present
        if hook is not None:
            hook(self, index)
