"""One staging copy of a source shard (`ros.client.slices`: a reader of slices reads each
source shard's chunks its blocks need into a staging copy of that shard's layout, and
copies the intersections out of it into place).

How much one stages at once (`STAGING_BUDGET`, `staging_groups`), where the copy lives
(`staging_device`: on the slices' GPU when they are all on one, else host memory), the
read into it (`read_group`: the delta base, the chunks a step before carried over, the
chunks a step ahead leaves to the step before), and the copy out (`copy_parts`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ros.client import slice_ahead, slice_fill, slice_ranges
from ros.client.deadline import Deadline
from ros.client.delta_bases import Staged
from ros.client.delta_fetch import DeltaReader
from ros.client.orchestrator import Target
from ros.client.slice import Slice
from ros.client.slice_carry import Carry
from ros.client.slice_fetch import SliceFetch
from ros.client.slice_plan import Copy, SliceRead, SourceShard, needed_chunks
from tensorhub.errors import (
    BadRange,
    DeadlineExceeded,
    IntegrityError,
    OutOfMemory,
    TransportError,
)
from transport.boxes import byte_span, chunks_for
from transport.layout import Layout, TensorSpec, torch_dtype
from transport.outcome import FetchStats, add_moved
from transport.reader import DEFAULT_PARALLEL
from transport.store import HeldVersion

log = logging.getLogger(__name__)

STAGING_BUDGET = 64 * 1024 * 1024
"""Bytes of a source shard's chunks a read without deltas stages at once (`staging_groups`).
Each group's staging is handed back to the system once its blocks are copied out
(`ros.cli.rss.give_back_freed`): glibc keeps freed pages of blocks this size resident once
its mmap threshold has risen, and the next group's staging then takes new pages, so without
it the resident peak of a read grows by a group's chunks with every group."""


def staging_groups(
    copies: Sequence[Copy],
    layout: Layout,
    specs: Mapping[str, TensorSpec],
    budget: int | None = None,
) -> list[list[Copy]]:
    """`copies` in groups whose chunks of the source shard add up to at most `budget`
    bytes (None: `STAGING_BUDGET`; a copy whose own chunks exceed it, alone), in order: a
    read without deltas stages one group at a time, so its peak extra memory is one group's
    chunks, not every chunk of the shard its slices touch."""
    limit = STAGING_BUDGET if budget is None else budget
    groups: list[list[Copy]] = [[]]
    size = 0
    for c in copies:
        spec = specs[c.name]
        first, end = byte_span(c.source, c.part, torch_dtype(spec.dtype).itemsize)
        mine = len(chunks_for(layout, spec, first, end)) * layout.chunk_size
        if groups[-1] and size + mine > limit:
            groups.append([])
            size = 0
        groups[-1].append(c)
        size += mine
    return groups


@dataclass(frozen=True)
class StagingOptions:
    """How one reader stages and reads its part of a source shard, the same for each of its
    staging copies: with `deltas`, the copy kept from the last call is the base the deltas
    are applied to (and this one is kept for the next); with `carry` (a layout reader's
    steps), chunks a step before read are taken from it and those a later step needs kept
    for it; `gpu`, held while a staging copy in GPU memory is in use (reads that run at
    once: one such copy at a time); with `fill` (a layout reader's), each chunk's parts are
    copied out as it is verified (`ros.client.slice_fill`); `budget`, the bytes staged at
    once (None: `STAGING_BUDGET`); `parallel`, the connections of each read."""

    deltas: DeltaReader | None = None
    carry: Carry | None = None
    gpu: threading.Lock | None = None
    fill: slice_fill.Fill | None = None
    budget: int | None = None
    parallel: int = DEFAULT_PARALLEL


def read_group(
    read: SliceRead,
    source: SourceShard,
    copies: list[Copy],
    result: SliceFetch,
    options: StagingOptions,
    step: slice_ahead.Step | None = None,
    last: bool = True,
) -> None:
    """`slice_read._read_part` for one staging copy: the chunks `copies` need, into a
    staging copy of the shard's layout allocated here (or the delta base kept from the
    last call), then the intersections copied out. With `step` (`last`: the step's last
    staging copy), the chunks the step in flight before it reads too are not asked for:
    they are taken from `carry` once that step ended (`slice_ahead.Step.later`)."""
    runs, model, version, deadline = read.runs, read.model, read.version, read.deadline
    shard, holders, manifest = source.shard, source.holders, source.manifest
    layout, specs, slices = source.layout, source.specs, read.slices
    deltas, carry, fill, parallel = options.deltas, options.carry, options.fill, options.parallel
    device = staging_device([slices[c.name].tensor for c in copies])
    with gpu_slot(options.gpu if device.type == "cuda" else None, deadline):
        needed = needed_chunks(copies, layout, specs)
        base = deltas.staged.take(model, shard) if deltas is not None else None
        if base is not None and not fits(base, layout, needed, device):
            base.drop()
            base = None
        tensors = base.tensors if base is not None else _allocate_staging(
            layout, device, model, version, shard
        )  # fmt: skip
        filling = None if fill is None else fill.staging(layout, tensors, copies)
        staging = filling or HeldVersion.reader(read.me.tenant, model, version, layout, tensors)
        applied = None
        if deltas is not None and base is not None and manifest.HasField("delta"):
            applied = deltas.apply(
                model, shard, manifest, staging, base.version, deadline, needed, hold=False
            )
            result.deltas[shard] = applied.stats
        if carry is not None:
            carry.restore(shard, staging, needed)
        missing = [i for i in sorted(needed) if not staging.is_present(i)]
        ranges = None
        ranged = FetchStats()  # the bytes of byte ranges, a read that failed included
        declared = fill is not None and filling is not None and fill.publisher is not None
        if declared and device.type == "cpu" and deltas is None and missing:
            # only the bytes the blocks take; each chunk of the block set is checked
            # against the publisher's wsum64 before it is served (`Fill`)
            ranges = slice_ranges.needed_ranges(copies, layout, specs, set(missing))
        later = (
            step.later(missing) if step is not None and carry is not None and not ranges else set()
        )
        ask = [i for i in missing if i not in later]
        if step is not None:
            step.asking(len(ask), last=last)
        landed, stop = (step.landed, step.stop.event) if step is not None else (None, None)
        target = Target(
            model, version, shard, staging, manifest,
            chunks=needed if step is None else ask, holder=False,
        )  # fmt: skip
        try:
            stats = FetchStats()  # every chunk carried over from a step before
            if ranges and fill is not None and filling is not None:
                try:
                    slice_ranges.read(
                        read, target, holders, ranges, parallel,
                        _landed(fill, filling, copies, landed), ranged,
                    )  # fmt: skip
                    ask = []
                except (TransportError, IntegrityError, BadRange) as exc:
                    fill.note(f"{model}@{version} shard {shard}: byte ranges failed ({exc!r}), "
                              "its chunks read whole")  # fmt: skip
                    ask = [i for i in missing if not staging.is_present(i)]
                    target = Target(model, version, shard, staging, manifest, ask, False)
            if (carry is None and not ranges) or ask:
                stats = runs.run(
                    target, holders, deadline, rate_floor=read.rate_floor, progress=read.progress,
                    landed=landed, stop=stop, parallel=parallel,
                )  # fmt: skip
            if later and step is not None and carry is not None:  # read by the step before
                step.wait_before(deadline)
                carry.restore(shard, staging, later)
                rest = [i for i in later if not staging.is_present(i)]
                if rest:  # not kept for us (never: `Carry.plan` counts every step)
                    again = Target(model, version, shard, staging, manifest, rest, False)
                    more = runs.run(
                        again, holders, deadline, rate_floor=read.rate_floor, stop=stop,
                        parallel=parallel,
                    )  # fmt: skip
                    add_moved(result, more)
        except BaseException:
            if base is not None:
                base.drop()
            if applied is not None and applied.keep is not None:
                applied.keep.release(force=True)
            raise
        if deltas is not None:
            companion = applied.keep if applied is not None else None
            if base is not None and companion is None:
                base.drop()
            kept = Staged(version, layout, tensors, frozenset(needed), companion)
            deltas.staged.put(model, shard, kept)
        add_moved(result, stats)
        add_moved(result, ranged)
        if fill is None or filling is None:
            copy_parts(copies, staging.tensors, slices)
        else:  # copied out as each chunk was verified
            fill.finish(filling, needed, copies)
        if carry is not None:
            carry.keep(shard, staging, needed)


def _landed(
    fill: slice_fill.Fill,
    filling: slice_fill.FillStaging,
    copies: Sequence[Copy],
    landed: Callable[[int], None] | None,
) -> Callable[[int], None]:
    """What a read of byte ranges tells of each trainer chunk whose ranges are all in
    place: its parts are copied out (each chunk of the block set checked against the
    publisher's sums once complete: `Fill`), and the step counts it landed."""

    def arrived(index: int) -> None:
        fill.arrived(filling, index, copies)
        if landed is not None:
            landed(index)

    return arrived


@contextmanager
def gpu_slot(gpu: threading.Lock | None, deadline: Deadline) -> Iterator[None]:
    """Hold `gpu` (when given) within the deadline: one staging copy in GPU memory at a
    time across the layout steps' pipelines."""
    if gpu is None:
        yield
        return
    if not gpu.acquire(timeout=deadline.work(float("inf"))):
        raise DeadlineExceeded(f"{deadline.what}: deadline passed waiting for GPU staging")
    try:
        yield
    finally:
        gpu.release()


def fits(base: Staged, layout: Layout, needed: set[int], device: torch.device) -> bool:
    """Whether a kept staging copy can be the base of this read: the same layout, on the
    same device, holding every chunk this read needs."""
    first = next(iter(base.tensors.values()), None)
    on = first.device if first is not None else torch.device("cpu")
    return base.layout == layout and needed <= base.filled and on.type == device.type


def staging_device(destinations: Sequence[torch.Tensor]) -> torch.device:
    """Where to stage a source shard: on the CUDA device of the tensors it fills when they
    are all on that one device (the intersections are then copied device to device), else
    in host memory (CPU destinations, or destinations on several devices: each is then
    filled from host memory, by a host-to-device copy where it is on a GPU)."""
    devices = {t.device for t in destinations}
    if len(devices) == 1:
        (device,) = devices
        if device.type == "cuda":
            return device
    return torch.device("cpu")


def _allocate_staging(
    layout: Layout, device: torch.device, model: str, version: int, shard: int | None
) -> dict[str, torch.Tensor]:
    """A staging copy of a source shard's layout on `device`; host memory if it does not
    fit on the GPU (logged: the slices are then filled by host-to-device copies)."""
    if device.type == "cuda":
        try:
            return layout.allocate(device)
        except OutOfMemory as exc:
            what = f"{model}@{version}" + ("" if shard is None else f" shard {shard}")
            log.warning(
                "fetch_slices %s: its staging copy (%d bytes) does not fit on %s (%s); "
                "staging it in host memory instead", what, layout.total_bytes, device, exc,
            )  # fmt: skip
    return layout.allocate()


def copy_parts(
    copies: Sequence[Copy], sources: Mapping[str, torch.Tensor], slices: Mapping[str, Slice]
) -> None:
    """Copy each intersection `c.part` from its source shard's tensor (`sources[c.name]`,
    which holds `c.source`) into the slice that wants it, in place: a strided `copy_` into
    a view of the slice's own tensor (detached: a slice may be a model's parameter), on
    whatever device both are. For a destination in GPU memory the copies are waited for
    before this returns (as a `fetch` into GPU memory has every chunk in place when it
    returns), so the tensors are filled for every CUDA stream and thread that reads them."""
    gpus = {t.device for t in sources.values() if t.is_cuda}
    for device in gpus:  # the transport's copies into the staging are done, on any stream
        torch.cuda.synchronize(device)
    for c in copies:
        want = slices[c.name]
        dest = want.tensor.detach()[c.part.slices_in(want.box)]
        dest.copy_(sources[c.name][c.part.slices_in(c.source)])
        if dest.is_cuda:
            gpus.add(dest.device)
    for device in gpus:
        torch.cuda.synchronize(device)
