"""The reads of the trainer's source shards for a reader of slices (`ros.client.slices`):
which source shard is read when, and in how many threads.

A reader that is no holder reads its source shards one at a time with deltas (each
shard's staging is kept as the next read's base), else `SHARDS_AT_ONCE` at a time
(`read_sources`). A reader in a layout (`ros.client.slice_layout`) reads the blocks no peer
gave in steps of whole blocks, a pipeline per source shard, the shards at once
(`read_steps`). Either reads each shard's part in staging copies of at most its share of
`slice_staging.STAGING_BUDGET` (`_read_part`, `ros.client.slice_staging`).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import replace

from ros.cli.rss import give_back_freed
from ros.client import layouts, slice_ahead, slice_fill, slice_staging
from ros.client.delta_fetch import DeltaReader
from ros.client.orchestrator import Progress, ProgressCallback
from ros.client.slice_carry import Carry
from ros.client.slice_fetch import SliceFetch, merge
from ros.client.slice_plan import Copy, SliceRead, SourceShard, needed_chunks, shard_order
from ros.client.slice_staging import StagingOptions, read_group, staging_device, staging_groups
from transport.reader import DEFAULT_PARALLEL
from transport.store import HeldVersion

SHARDS_AT_ONCE = 4
"""Source shards a reader that is no holder reads at once, without deltas (`read_sources`):
each in its own thread, over its own connections, staged in groups of its share of
`slice_staging.STAGING_BUDGET`."""


def read_sources(
    read: SliceRead,
    plan: Mapping[int, list[Copy]],
    result: SliceFetch,
    deltas: DeltaReader | None,
) -> None:
    """The source shards of `plan` for a reader that is no holder (the caller holds the
    version's pin). With `deltas` (each shard's staging kept as the base of the next call),
    or when there is one, one at a time. Else `SHARDS_AT_ONCE` at a time, from a random one
    on (`shard_order`), each staged in groups of its share of `STAGING_BUDGET` (so the peak
    extra memory stays one budget), over its share of the read's `DEFAULT_PARALLEL`
    connections (so the holders see as many as from a read of one shard) and in GPU memory
    one staging copy at a time. Read one after another, every reader of a version asked the
    first shard's holders first, all at once, and the other shards' holders sat idle
    (`bench reshard`'s slices series: the trainer links about half busy); at once, each
    holder's link carries its share of every reader's bytes from the start. The first
    failure cancels the shards not yet started; it is raised once the started ones end
    (their reads stop at the deadline), so the caller's pin outlives every read."""
    if deltas is not None or len(plan) == 1:  # a delta's bases: one shard at a time
        for index, copies in plan.items():
            _read_part(read, read.source(index), copies, result, StagingOptions(deltas=deltas))
        return
    order = shard_order(plan)
    at_once = min(SHARDS_AT_ONCE, len(order))
    options = StagingOptions(
        gpu=threading.Lock(),
        budget=max(1, slice_staging.STAGING_BUDGET // at_once),
        parallel=max(1, DEFAULT_PARALLEL // at_once),
    )
    serialized = replace(read, progress=_one_at_a_time(read.progress))

    def one(index: int) -> SliceFetch:
        mine = SliceFetch(read.version)
        _read_part(serialized, read.source(index), plan[index], mine, options)
        return mine

    with ThreadPoolExecutor(at_once, thread_name_prefix="slices-shard") as pool:
        futures = [pool.submit(one, index) for index in order]
        wait(futures, return_when=FIRST_EXCEPTION)
        for future in futures:
            future.cancel()  # those not started yet; a failure's shards stop here
    for future in futures:
        failed = None if future.cancelled() else future.exception()
        if failed is not None:
            raise failed
    for future in futures:
        merge(result, future.result())


def _read_part(
    read: SliceRead,
    source: SourceShard,
    copies: list[Copy],
    result: SliceFetch,
    options: StagingOptions,
    step: slice_ahead.Step | None = None,
) -> None:
    """Fetch the chunks of one source shard that `copies` need (and only those: the others
    of the staging copy stay missing), then copy the intersections out, in place, staged
    as `options` say (`StagingOptions`: a delta base, chunks carried between a layout
    reader's steps, one GPU staging copy at a time across reads that run at once, the
    parts copied out as each chunk is verified, the budget and the connections). `step` (a
    layout reader's) is told what each round asks for and what lands, so that the next
    step can ask for its own before this one has arrived (`ros.client.slice_ahead`).

    The staging copy lives where the destinations are (`staging_device`): for slices in GPU
    memory it is on their device, so the bytes take the transports' path into GPU memory
    (as `fetch(into=...)`: IPC, or TCP -> pinned buffer -> device) and each intersection
    is copied device to device, strided, into the slice's own memory; nothing goes back
    through host memory and no tensor in GPU memory is viewed as numpy."""
    groups = (
        staging_groups(copies, source.layout, source.specs, options.budget)
        if options.deltas is None
        else [copies]
    )
    for n, group in enumerate(groups):  # one staging copy at a time (`STAGING_BUDGET`)
        read_group(read, source, group, result, options, step, n == len(groups) - 1)
        give_back_freed()  # its staging, freed as it returned: resident no more


def read_steps(
    read: SliceRead,
    steps: list[dict[int, list[Copy]]],
    dest: HeldVersion,
    done: set[str],
    result: SliceFetch,
    fill: slice_fill.Fill,
) -> None:
    """Read `steps` from the trainer's shards: one pipeline per source shard, all at once,
    each reading its part of step after step (`_read_part`, with the chunks that steps
    share carried over: `Carry`), the next step's request out once the step before has
    most of its chunks (`slice_ahead`: one step ahead at most, within `STAGING_BUDGET`; the
    first failure cuts every request still out); each trainer chunk's parts are copied
    into `dest` as it is verified, and each chunk of `dest` is served as soon as its own
    bytes are in place (`fill`), not when its blocks or the step are (`layouts.settle`,
    after each step, marks what no trainer byte goes into). So the reader's link takes
    the shards' bytes at once, with no round trip between one shard's read and the next
    nor between one step's and the next, and it serves its chunks at the rate they
    arrive, not in bursts (docs/design-notes.md, "Readers in another layout")."""
    carry = Carry()
    pipelines: dict[int, list[list[Copy]]] = {}
    left: dict[str, int] = {}  # per block: the source shards' parts not in place yet
    for step in steps:
        for index, copies in step.items():
            layout_i, specs = read.layout(index)
            carry.plan(read.shard_of(index), needed_chunks(copies, layout_i, specs))
            pipelines.setdefault(index, []).append(copies)
            for c in copies:
                left[c.name] = left.get(c.name, 0) + 1
    if not pipelines:
        return
    lock = threading.Lock()
    # one staging copy in GPU memory at a time, as a plain read
    options = StagingOptions(carry=carry, gpu=threading.Lock(), fill=fill)
    stop = slice_ahead.Stop()  # the first failure stops every step still out
    window = slice_ahead.Window(slice_staging.STAGING_BUDGET)  # the staging of the steps in flight
    serialized = replace(read, progress=_one_at_a_time(read.progress))

    def one(source: SourceShard, copies: list[Copy], step: slice_ahead.Step) -> SliceFetch:
        """One step of `source` (in a thread of its pipeline's)."""
        mine = SliceFetch(read.version)
        try:
            _read_part(serialized, source, copies, mine, options, step)
        except BaseException as exc:
            stop.fail(exc)
            step.end(ok=False)
            raise
        step.end(ok=True)
        return mine

    def pipeline(index: int) -> SliceFetch:
        """Source shard `index`'s steps in order, each started once the one before it has
        `slice_ahead.AHEAD_AT` of its chunks (at most one step ahead, within `window`)."""
        mine = SliceFetch(read.version)
        source = read.source(index)
        layout_i, specs = source.layout, source.specs
        running: list[tuple[slice_ahead.Step, Future[SliceFetch], list[Copy], int]] = []

        def settle() -> None:
            """Wait for the oldest step in flight; count its blocks' parts as in place."""
            _, future, copies, size = running.pop(0)
            try:
                merge(mine, future.result())
            finally:
                window.give(size)
            with lock:
                for c in copies:
                    left[c.name] -= 1
                    if left[c.name] == 0:
                        done.add(c.name)
                layouts.settle(dest, done, fill.unverified())

        with ThreadPoolExecutor(2, thread_name_prefix="slices-step") as ahead:
            try:
                for copies in pipelines[index]:
                    if stop.event.is_set():  # another step failed: the read fails with it
                        break
                    needed = needed_chunks(copies, layout_i, specs)
                    size = len(needed) * layout_i.chunk_size
                    on_gpu = staging_device([read.slices[c.name].tensor for c in copies]).type
                    before = running[-1][0] if running else None
                    if before is not None:
                        before.wait_go(read.deadline)
                        if on_gpu == "cuda" or before.ended or not window.try_take(size):
                            settle()  # not ahead: after the step before, as it fits
                            before = None
                    if before is None:
                        window.take(size)
                    step = slice_ahead.Step(needed, before, stop)
                    running.append((step, ahead.submit(one, source, copies, step), copies, size))
                    while len(running) > 1:  # at most one step ahead
                        settle()
                while running:
                    settle()
            except BaseException as exc:
                stop.fail(exc)  # the steps still out are cut before the pool is left
                raise
        return mine

    with ThreadPoolExecutor(len(pipelines), thread_name_prefix="slices-shard") as pool:
        futures = [pool.submit(pipeline, index) for index in sorted(pipelines)]
        wait(futures)
    stop.raise_first()  # the first failure, once every pipeline and step has stopped
    for future in futures:
        merge(result, future.result())


def _one_at_a_time(progress: ProgressCallback | None) -> ProgressCallback | None:
    """`progress`, called by one shard's pipeline at a time: the pipelines run in threads,
    and a callback written for `fetch` (one thread) need not be thread-safe."""
    if progress is None:
        return None
    lock = threading.Lock()
    call = progress

    def serialized(p: Progress) -> None:
        with lock:
            call(p)

    return serialized
