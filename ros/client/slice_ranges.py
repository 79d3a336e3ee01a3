"""The first reader of a declared layout reads only the bytes of each trainer chunk its
blocks need (GET_RANGES: `transport.ranged`), not whole chunks (docs/design-notes.md,
"Readers in another layout").

A trainer chunk holds a flat byte range of each tensor it touches; a block's part of a
source shard is a box of that shard's tensor, whose elements are runs of consecutive bytes
(`box_runs`: one per row of the dimensions it does not take whole). `needed_ranges` cuts
those runs at the chunks' bounds: the byte ranges of each trainer chunk that the block set
takes, and nothing else. A range cannot be checked against the manifest (its checksums are
of whole chunks); what is checked is each chunk of the reader's own block set, once every
range it is made of is in place, against the publisher's wsum64 of it (`slice_fill.Fill`,
with `publisher`): nothing is marked present or served before. `read` asks the trainer's
holders over TCP, the chunks split into `parallel` connections, and tells `landed` each
chunk whose ranges have all landed (its parts are copied out then, as a whole chunk's
are when it is verified).

What `read` asks for is `bounded`: a range costs a frame and a checksum at each end
whatever its size, so ranges of a chunk less than `GAP` bytes apart are asked as one, and a
chunk whose ranges would number more than one per `SPAN_PER_RANGE` bytes of it, or carry
`WHOLE_FRACTION` of its bytes with their frames, is asked for whole, as one range. The
extra bytes are the trainer chunk's own, received into the staging copy beside the blocks'
and checked as theirs are (each range's xxh3-64 on the way); nothing is marked present or
served from a staging copy read in ranges, and only the blocks' parts are copied out of it.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

from ros.client.orchestrator import Target
from ros.client.slice_plan import Copy, SliceRead
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from tensorhub.errors import RangesUnsupported
from transport.boxes import Box
from transport.layout import Layout, TensorSpec, torch_dtype
from transport.outcome import FetchStats
from transport.wire import CHUNK_FIXED, HEADER, MAX_RANGES_PER_GET, RANGE, ChunkRange

RANGE_FRAME = HEADER.size + CHUNK_FIXED.size + 2 + RANGE.size
"""Bytes a range puts on the wire besides its own (62): its CHUNK frame's header and fixed
fields and the two name lengths (the tenant's and model's names come on top), and its entry
in the GET_RANGES body."""

GAP = 64
"""Ranges of one chunk fewer than this many bytes apart are asked for as one range, the
gap's bytes included. A gap that small costs fewer bytes than the separate range's frame
(`RANGE_FRAME` plus the names: at least 64), so the merge is free on any link and saves a
frame and an xxh3 at each end. Wider gaps are not merged: measured on loopback, unshaped
(2 cores, load 1.5-1.8, `docs/design-notes.md`), a range costs about 22 µs of wall time,
20 µs of the reader's CPU and 10 µs of the holder's whatever its size (64 B to 1 KiB); a gap is
worth that time up to 22 µs of the link, about 22 KiB on loopback but 275 B at 100 Mbit/s,
and every byte of it is a byte more into the reader's host: the half rows of a row-parallel
tensor (`bench reshard --trainer-hosts 1`: 1 to 2 KiB ranges as far apart) would double."""

WHOLE_FRACTION = 0.95
"""A chunk whose ranges, with their frames (`RANGE_FRAME` each), come to this fraction of
its bytes or more is asked for whole, as one range: it then moves at most 1/0.95 = 1.053x
the bytes its ranges would have, the bound `bench reshard` sets on the bytes into a worker's
host (1.05x its blocks), in one frame."""

SPAN_PER_RANGE = 256
"""A chunk asked for in more than one range per this many bytes of it is asked for whole,
as one range: at about 22 µs a range (loopback, measured as `GAP` says), more ranges cost
more time than the whole chunk takes on a 100 Mbit/s link (256 B is 20 µs there), and on
faster links the whole chunk is quicker still (a 64 KiB chunk: about 90 µs on loopback, as
much as four ranges). A 64 KiB chunk takes up to 256 ranges, a 4 MiB one 16,384; the bench's
half rows (16 or 32 ranges of a 64 KiB chunk) stay ranges."""


def box_runs(shape: Sequence[int], box: Box) -> list[tuple[int, int]]:
    """The elements of `box` (local coordinates of a row-major array of `shape`) as runs
    of consecutive flat indices, (first, count), in flat order: the trailing dimensions the
    box takes whole merge into one run."""
    if box.volume == 0:
        return []
    n = len(shape)
    if n == 0:  # a scalar: one element
        return [(0, 1)]
    d = n - 1  # the last dimension the box does not take whole (runs span d..n-1)
    while d > 0 and box.shape[d] == shape[d] and box.offsets[d] == 0:
        d -= 1
    inner = math.prod(shape[d + 1 :])
    length = box.shape[d] * inner
    strides = [math.prod(shape[k + 1 :]) for k in range(n)]
    runs: list[tuple[int, int]] = []

    def walk(k: int, base: int) -> None:
        if k == d:
            runs.append((base + box.offsets[d] * strides[d], length))
            return
        for i in range(box.offsets[k], box.offsets[k] + box.shape[k]):
            walk(k + 1, base + i * strides[k])

    walk(0, 0)
    return runs


def needed_ranges(
    copies: Iterable[Copy],
    layout: Layout,
    specs: Mapping[str, TensorSpec],
    chunks: Collection[int],
) -> list[ChunkRange]:
    """The byte ranges, within the chunks of `chunks` of a source shard's `layout`, that
    `copies` take (offsets within each chunk's payload: its segments back to back), sorted,
    adjacent ones merged: exactly the bytes they take (what is asked for: `bounded`)."""
    index_of = {spec.name: i for i, spec in enumerate(layout.tensors)}
    size = layout.chunk_size
    placed: dict[int, list[tuple[int, int, int]]] = {}  # chunk: (tensor, flat start, payload at)
    out: list[ChunkRange] = []
    for c in copies:
        spec = specs[c.name]
        tensor = index_of[c.name]
        item = torch_dtype(spec.dtype).itemsize
        local = Box(
            tuple(p - o for p, o in zip(c.part.offsets, c.source.offsets, strict=True)),
            c.part.shape,
        )
        for first, count in box_runs(spec.shape, local):
            a = spec.offset + first * item
            b = a + count * item
            for chunk in range(a // size, (b - 1) // size + 1):
                if chunk not in chunks:
                    continue
                if chunk not in placed:
                    at, segs = 0, []
                    for seg in layout.segments(chunk):
                        segs.append((seg.tensor, layout.tensors[seg.tensor].offset + seg.start, at))
                        at += seg.length
                    placed[chunk] = segs
                lo_chunk, hi_chunk = chunk * size, (chunk + 1) * size
                lo, hi = max(a, lo_chunk), min(b, hi_chunk)
                for t, flat, at in placed[chunk]:
                    if t == tensor:  # a tensor is one segment of a chunk
                        out.append(ChunkRange(chunk, at + lo - flat, hi - lo))
                        break
    return _merged(out, 1)


def bounded(ranges: Sequence[ChunkRange], layout: Layout) -> list[ChunkRange]:
    """What a reader asks for to receive `ranges` (sorted by chunk, apart: `needed_ranges`)
    of `layout`'s chunks: per chunk, the ranges fewer than `GAP` bytes apart merged, or
    one range of the whole chunk where they would number more than one per
    `SPAN_PER_RANGE` bytes of it or come to `WHOLE_FRACTION` of it with their frames. A
    superset of `ranges`, sorted, each chunk's no more than `max_ranges` of it."""
    out: list[ChunkRange] = []
    for chunk, group in itertools.groupby(ranges, key=lambda r: r.chunk):
        merged = _merged(list(group), GAP)
        size = layout.payload_bytes(chunk)
        wire = sum(r.length + RANGE_FRAME for r in merged)
        if len(merged) > max_ranges(size) or wire >= WHOLE_FRACTION * size:
            out.append(ChunkRange(chunk, 0, size))
        else:
            out.extend(merged)
    return out


def max_ranges(size: int) -> int:
    """The most ranges `bounded` asks of a chunk of `size` payload bytes (at least 1)."""
    return max(1, size // SPAN_PER_RANGE)


def _merged(ranges: list[ChunkRange], gap: int) -> list[ChunkRange]:
    """`ranges` sorted, those of a chunk fewer than `gap` bytes apart (or overlapping) as
    one."""
    out: list[ChunkRange] = []
    for r in sorted(ranges, key=lambda r: (r.chunk, r.offset)):
        if out and out[-1].chunk == r.chunk and out[-1].offset + out[-1].length + gap > r.offset:
            last = out[-1]
            end = max(last.offset + last.length, r.offset + r.length)
            out[-1] = ChunkRange(last.chunk, last.offset, end - last.offset)
        else:
            out.append(r)
    return out


def _requests(ranges: Sequence[ChunkRange], parts: int) -> list[list[list[ChunkRange]]]:
    """`ranges` (sorted by chunk) for `parts` connections, the chunks dealt out in turn
    (connection k takes chunks k, k + parts, ...: the connections go through the chunks
    side by side, so the block set's chunks complete about in order, the order the
    readers chained behind ask for them in), each connection's in requests of at most
    `MAX_RANGES_PER_GET` ranges that never split a chunk's ranges (unless one chunk has
    more than that)."""
    by_chunk: list[list[ChunkRange]] = []
    for r in ranges:
        if by_chunk and by_chunk[-1][0].chunk == r.chunk:
            by_chunk[-1].append(r)
        else:
            by_chunk.append([r])
    out: list[list[list[ChunkRange]]] = []
    for k in range(min(parts, len(by_chunk))):
        requests: list[list[ChunkRange]] = [[]]
        for group in by_chunk[k::parts]:
            if requests[-1] and len(requests[-1]) + len(group) > MAX_RANGES_PER_GET:
                requests.append([])
            for r in group:
                if len(requests[-1]) == MAX_RANGES_PER_GET:
                    requests.append([])
                requests[-1].append(r)
        out.append(requests)
    return out


def read(
    job: SliceRead,
    target: Target,
    holders: pb.ResolveResponse,
    ranges: Sequence[ChunkRange],
    parallel: int,
    landed: Callable[[int], None],
    moved: FetchStats,
) -> None:
    """Read `ranges` of `target`'s staging copy (of `job`'s read) from the nearest holder
    `holders` names over TCP, as `bounded` asks for them (the gaps' and whole chunks' bytes
    too), in `parallel` connections, within `job`'s deadline; `landed`
    is told each chunk once all its ranges are in place (unverified: the caller's block-set
    check decides); `moved` counts the bytes received, those of a read that fails part-way
    included. Raises what a connection raised (`RangesUnsupported` when no holder is on TCP
    or the holder does not know the frame): the caller then reads whole chunks."""
    runs, tls = job.runs, job.me.tls
    sources, token = runs.ranged_plan(target, holders, job.deadline)
    if not sources:
        raise RangesUnsupported("no holder of the source shard is reachable over TCP")
    source = sources[0]
    end = job.deadline.work_end
    lock = threading.Lock()

    def one(requests: list[list[ChunkRange]]) -> None:
        for request in requests:
            got = runs.read_ranges(
                source, target.dest, request, token=token(), deadline=end, tls=tls,
                landed=landed,
            )  # fmt: skip
            with lock:
                have = moved.bytes_per_source.get(source.holder_id, 0)
                moved.bytes_per_source[source.holder_id] = have + got
                moved.chunks += len({r.chunk for r in request})

    start = time.monotonic()
    plan = _requests(bounded(ranges, target.dest.layout), parallel)
    with ThreadPoolExecutor(max(1, len(plan)), thread_name_prefix="slices-ranges") as pool:
        for _ in pool.map(one, plan):
            pass
    moved.duration += time.monotonic() - start
