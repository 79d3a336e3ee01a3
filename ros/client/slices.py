"""Reading a model-parallel version in another layout (resharding: docs/design.md,
"Model-parallel versions").

Trainer ranks publish their shards with placements (the block of each global tensor a rank
holds). A reader in another layout — TP 8 → TP 32, or TP 2 → one whole model — names the
block it wants of each global tensor (`Slice`), and `fetch_slices` reads, from the holders
of each source shard, only the chunks that contain its intersection with that block, checks
them against the publisher's checksums, and copies the intersection into place.

Source shards are read `SHARDS_AT_ONCE` at a time, each into a staging copy of that shard's
layout of which only the needed chunks are filled, in groups that together stay within
`STAGING_BUDGET` (a read with deltas: one shard at a time, each shard's staging kept as the
next read's base; a reader in a layout stages one step's part of each source shard at once,
and the next step's while that one arrives when both fit `STAGING_BUDGET`:
`ros.client.slice_ahead`); either holds one staging copy in GPU memory at a time. A reader of
slices becomes a holder of its blocks when it names their layout (`layout=`,
`ros.client.layouts`): it serves them as a PARTIAL holder from the start, reads them first
from the other holders of the same blocks (pipelined: from one registered before it, as
that one reads them), checked against checksums derived from publisher-verified bytes,
reads only what they did not give from the trainer's shards, in steps of whole blocks (a
pipeline per source shard, the shards read at once, each chunk of its blocks served as soon
as its own bytes are in place: `ros.client.slice_fill`), and then registers as their
COMPLETE holder.
Without `layout`, it holds nothing; readers in the publisher's own layout use
`fetch(shard=i)`.

Slices in GPU memory: the staging copy is allocated on their device (when every slice a
source shard fills is on that one device) and filled exactly as a `fetch` into GPU memory
is (`transport.selection` with `device_memory`: same-host CUDA IPC where it can, else TCP
through pinned host buffers), and the intersections are copied device to device
into the slices' own memory. So the peak extra memory is then one source shard *on the
GPU*; a staging copy that does not fit there is put in host memory instead (logged). Host
staging would let an RDMA holder be read (its channel reads into host memory only), but
each intersection would then cost a strided host-side copy and a pageable host-to-device
copy, and a transport into GPU memory could not be used.
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from ros.cli.rss import give_back_freed
from ros.client import layout_cover, layout_delta, layouts, slice_ahead, slice_fill
from ros.client.deadline import Deadline
from ros.client.delta_bases import Staged
from ros.client.delta_fetch import DeltaReader, DeltaStats
from ros.client.fetching import DEFAULT_FETCH_TIMEOUT
from ros.client.identity import Identity
from ros.client.manifest import layout_of, placement_of
from ros.client.orchestrator import Orchestrator, Progress, ProgressCallback, Target
from ros.client.pins import Pins
from ros.client.read_token import RenewingToken
from ros.client.slice import Slice
from ros.client.slice_carry import Carry
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from tensorhub.errors import DeadlineExceeded, InvalidArgument, OutOfMemory, TensorHubError
from tensorhub.names import validate_name, validate_version
from transport.boxes import Box, byte_span, chunks_for
from transport.layout import Layout, TensorSpec, dtype_name, torch_dtype
from transport.outcome import FetchStats, add_moved
from transport.pace import DEFAULT_RATE_FLOOR
from transport.reader import DEFAULT_PARALLEL
from transport.store import HeldVersion

log = logging.getLogger(__name__)

STAGING_BUDGET = 64 * 1024 * 1024
"""Bytes of a source shard's chunks a read without deltas stages at once (`_staging_groups`).
Each group's staging is handed back to the system once its blocks are copied out
(`ros.cli.rss.give_back_freed`): glibc keeps freed pages of blocks this size resident once
its mmap threshold has risen, and the next group's staging then takes new pages, so without
it the resident peak of a read grows by a group's chunks with every group."""

SHARDS_AT_ONCE = 4
"""Source shards a reader that is no holder reads at once, without deltas (`_read_parts`):
each in its own thread, over its own connections, staged in groups of its share of
`STAGING_BUDGET`."""


@dataclass
class SliceFetch:
    """What `fetch_slices` read: the version, bytes per source holder, and the holders
    that failed (and why) before their chunks were read elsewhere."""

    version: int
    bytes_per_source: dict[str, int] = field(default_factory=dict)
    chunks: int = 0
    failed_sources: dict[str, str] = field(default_factory=dict)
    slow_sources: dict[str, float] = field(default_factory=dict)  # under the rate floor: B/s
    # delta=True: what the delta did for each source shard read (None: the whole version)
    deltas: dict[int | None, DeltaStats] = field(default_factory=dict)
    # layout=...: the blocks read from the trainer's shards (the others came from holders
    # of the same blocks), and whether this reader serves its blocks now
    from_trainer: set[str] = field(default_factory=set)
    served: bool = False
    # layout=...: the chunks read from peers (holders of the same blocks, or of a cover's
    # block sets) that were checked against the publisher's checksums (a layout declared
    # before the version's publish; 0: all against the reader-derived ones)
    publisher_checked: int = 0

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_per_source.values())


@dataclass
class _Copy:
    name: str
    source: Box  # the block the source shard holds
    part: Box  # the intersection to copy


def fetch_slices(
    runs: Orchestrator,
    pins: Pins,
    me: Identity,
    model: str,
    version: int | str = "latest",
    *,
    slices: Mapping[str, Slice],
    timeout: float = DEFAULT_FETCH_TIMEOUT,
    rate_floor: float = DEFAULT_RATE_FLOOR,
    progress: ProgressCallback | None = None,
    deltas: DeltaReader | None = None,
    layout: str | None = None,
    peers: layouts.LayoutPeers | None = None,
    cover: Sequence[str] = (),
) -> SliceFetch:
    """`Hub.fetch_slices` (its docstring says what a caller gets): plan which chunks of which source
    shard each slice needs, pin the version, run one non-holder `Target` per source shard
    through `runs`, and copy the intersections into place. With `deltas`, each source
    shard's staging copy is kept as the base of the next call, which applies the deltas
    to it. With `layout` (and the client's `peers`), the blocks are read from their
    holders first, then from the block sets of the layouts of `cover` that cover them
    (`ros.client.layout_cover`), only the rest from the source shards, and then served
    (`ros.client.layouts`)."""
    validate_name(model, "model")
    if not slices:
        raise InvalidArgument("fetch_slices needs at least one slice")
    number = 0 if version == "latest" else validate_version(version)
    deadline = Deadline.after(timeout, f"fetch_slices {model}@{version}")
    resolved = runs.resolve(model, number, None, deadline)
    found = int(resolved.version)
    parts = list(resolved.shards) or [resolved.manifest]
    plan = _plan(model, found, parts, slices)
    result = SliceFetch(found)
    blocks = None
    for other in cover:
        validate_name(other, "layout")
    if cover and layout is None:
        raise InvalidArgument("fetch_slices: `cover` needs the reader's own `layout`")
    if layout is not None:
        validate_name(layout, "layout")
        if peers is None:
            raise InvalidArgument("fetch_slices: a layout is read by its client")
        blocks = layouts.block_set(slices, int(parts[0].chunk_size))
        layouts.check_free(peers, me, model, blocks, found)
    if blocks is not None and peers is not None and layout is not None:
        # Its PARTIAL registration pins the version, in the same transaction, until it
        # registers COMPLETE or releases (`consistency.layouts`): no Pin or Unpin call.
        _read_layout(
            runs, peers, me, model, found, layout, cover, blocks, slices, parts, resolved,
            deadline, rate_floor, progress, result, deltas,
        )  # fmt: skip
        return result
    # A reader of slices that is no holder pins the version itself; the pin is its own
    # (not the holder name, whose pin a concurrent fetch of the version may hold).
    pin_id = f"slices-{secrets.token_hex(6)}"
    pins.pin(model, found, pin_id, deadline.work(me.timeout))
    try:
        if deltas is not None or len(plan) == 1:  # a delta's bases: one shard at a time
            for index, copies in plan.items():
                _read_part(
                    me, runs, model, found, _shard(resolved, index),
                    _holders(runs, model, found, resolved, index, deadline), parts[index],
                    copies, slices, deadline, result, rate_floor, progress, deltas,
                )  # fmt: skip
        else:
            _read_parts(
                me, runs, model, found, resolved, parts, plan, slices, deadline, result,
                rate_floor, progress,
            )  # fmt: skip
    finally:
        _unpin(pins, me, model, found, pin_id, deadline)
    return result


def _read_parts(
    me: Identity,
    runs: Orchestrator,
    model: str,
    version: int,
    resolved: pb.ResolveResponse,
    parts: list[pb.Manifest],
    plan: Mapping[int, list[_Copy]],
    slices: Mapping[str, Slice],
    deadline: Deadline,
    result: SliceFetch,
    rate_floor: float,
    progress: ProgressCallback | None,
) -> None:
    """The source shards of a reader that is no holder (without deltas), `SHARDS_AT_ONCE`
    at a time, from a random one on (`_shard_order`), each staged in groups of its share of
    `STAGING_BUDGET` (so the peak extra memory stays one budget), over its share of the
    read's `DEFAULT_PARALLEL` connections (so the holders see as many as from a read of one
    shard) and in GPU memory one staging copy at a time. Read one after another, every
    reader of a version asked the first shard's holders first, all at once, and the other
    shards' holders sat idle (`bench reshard`'s slices series: the trainer links about half
    busy); at once, each holder's link carries its share of every reader's bytes from the
    start. The first failure cancels the shards not yet started; it is raised once the
    started ones end (their reads stop at the deadline), so the caller's pin outlives every
    read."""
    order = _shard_order(plan)
    at_once = min(SHARDS_AT_ONCE, len(order))
    budget = max(1, STAGING_BUDGET // at_once)
    parallel = max(1, DEFAULT_PARALLEL // at_once)
    gpu = threading.Lock()
    serialized = _one_at_a_time(progress)

    def read(index: int) -> SliceFetch:
        mine = SliceFetch(version)
        _read_part(
            me, runs, model, version, _shard(resolved, index),
            _holders(runs, model, version, resolved, index, deadline), parts[index],
            plan[index], slices, deadline, mine, rate_floor, serialized, gpu=gpu, budget=budget,
            parallel=parallel,
        )  # fmt: skip
        return mine

    with ThreadPoolExecutor(at_once, thread_name_prefix="slices-shard") as pool:
        futures = [pool.submit(read, index) for index in order]
        wait(futures, return_when=FIRST_EXCEPTION)
        for future in futures:
            future.cancel()  # those not started yet; a failure's shards stop here
    for future in futures:
        failed = None if future.cancelled() else future.exception()
        if failed is not None:
            raise failed
    for future in futures:
        _merge(result, future.result())


def _shard_order(plan: Mapping[int, list[_Copy]]) -> list[int]:
    """The source shards of `plan` in order, from a random one on: readers that start at
    once start on different shards when there are more than `SHARDS_AT_ONCE`."""
    order = sorted(plan)
    first = secrets.randbelow(len(order))
    return order[first:] + order[:first]


def _shard(resolved: pb.ResolveResponse, index: int) -> int | None:
    return index if resolved.shards else None


def _holders(
    runs: Orchestrator,
    model: str,
    version: int,
    resolved: pb.ResolveResponse,
    index: int,
    deadline: Deadline,
) -> pb.ResolveResponse:
    """The holders of source shard `index` (a Resolve answers candidates of one shard only)."""
    shard = _shard(resolved, index)
    return resolved if shard is None else runs.holders(model, version, shard, deadline)


def _read_layout(
    runs: Orchestrator,
    peers: layouts.LayoutPeers,
    me: Identity,
    model: str,
    version: int,
    layout: str,
    cover: Sequence[str],
    blocks: layouts.BlockSet,
    slices: Mapping[str, Slice],
    parts: list[pb.Manifest],
    resolved: pb.ResolveResponse,
    deadline: Deadline,
    rate_floor: float,
    progress: ProgressCallback | None,
    result: SliceFetch,
    deltas: DeltaReader | None = None,
) -> None:
    """A reader in a layout (`ros.client.layouts`): serve the blocks as a PARTIAL holder
    (a registration that also pins the version), read them from the holders registered
    before us and the `cover` layouts, the rest from the trainer's shards in steps of whole
    blocks (`_read_steps`: each chunk served as soon as its bytes are in place), then register
    COMPLETE (which drops the pin). A failure stops the serving and deletes our record
    and its pin. With `deltas`, blocks that hold the version remembered for them first
    get the changes that fall inside them (`ros.client.layout_delta`), and the blocks
    served at the end are remembered as the base of the next read."""
    token = _renewing_token(runs, model, version, resolved, deadline)
    base = deltas.layout_bases.take(model, blocks) if deltas is not None else None
    held = layouts.start_holding(peers, me, model, version, layout, blocks, deadline)
    dest = held.dest
    try:
        if base is not None:
            read = layout_delta.BlockRead(
                runs, me.tenant, model, version, parts, lambda i: _shard(resolved, i), slices,
                blocks, dest, rate_floor,
            )  # fmt: skip
            applied = layout_delta.apply_deltas(
                read, _plan(model, version, parts, slices), base, list(held.found.block_sums),
                list(held.found.publisher_sums), deadline,
            )  # fmt: skip
            result.deltas.update(applied.stats)
            add_moved(result, applied.moved)
        recorded = _from_holders(
            peers, me, model, version, layout, cover, blocks, held, slices, token,
            deadline, rate_floor, result,
        )  # fmt: skip
        done = set(slices) - result.from_trainer
        layouts.settle(dest, done)
        todo = {name: slices[name] for name in sorted(result.from_trainer)}
        plan = _plan(model, version, parts, todo) if todo else {}
        fill = slice_fill.Fill(dest, {name: want.box for name, want in todo.items()}, todo)
        _read_steps(
            runs, me, model, version, resolved, parts, _steps(plan, blocks), slices, dest,
            done, deadline, result, rate_floor, progress, fill,
        )  # fmt: skip
        result.served = layouts.finish_holding(
            peers, me, model, version, layout, blocks, dest, recorded, deadline
        )
        if deltas is not None and result.served:
            deltas.layout_bases.remember(model, blocks, version, dest)
    except BaseException:
        layouts.release(peers, me, model, version, layouts.cleanup_time(me, deadline))
        raise


def _read_steps(
    runs: Orchestrator,
    me: Identity,
    model: str,
    version: int,
    resolved: pb.ResolveResponse,
    parts: list[pb.Manifest],
    steps: list[dict[int, list[_Copy]]],
    slices: Mapping[str, Slice],
    dest: HeldVersion,
    done: set[str],
    deadline: Deadline,
    result: SliceFetch,
    rate_floor: float,
    progress: ProgressCallback | None,
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
    pipelines: dict[int, list[list[_Copy]]] = {}
    left: dict[str, int] = {}  # per block: the source shards' parts not in place yet
    for step in steps:
        for index, copies in step.items():
            layout_i = layout_of(parts[index])
            specs = {spec.name: spec for spec in layout_i.tensors}
            carry.plan(_shard(resolved, index), _needed(copies, layout_i, specs))
            pipelines.setdefault(index, []).append(copies)
            for c in copies:
                left[c.name] = left.get(c.name, 0) + 1
    if not pipelines:
        return
    lock = threading.Lock()
    gpu = threading.Lock()  # one staging copy in GPU memory at a time, as a plain read
    stop = slice_ahead.Stop()  # the first failure stops every step still out
    window = slice_ahead.Window(STAGING_BUDGET)  # the staging of the steps in flight
    progress = _one_at_a_time(progress)

    def read(
        index: int, holders: pb.ResolveResponse, copies: list[_Copy], step: slice_ahead.Step
    ) -> SliceFetch:
        """One step of source shard `index` (in a thread of its pipeline's)."""
        mine = SliceFetch(version)
        try:
            _read_part(
                me, runs, model, version, _shard(resolved, index), holders, parts[index],
                copies, slices, deadline, mine, rate_floor, progress, carry=carry,
                gpu=gpu, fill=fill, step=step,
            )  # fmt: skip
        except BaseException as exc:
            stop.fail(exc)
            step.end(ok=False)
            raise
        step.end(ok=True)
        return mine

    def pipeline(index: int) -> SliceFetch:
        """Source shard `index`'s steps in order, each started once the one before it has
        `slice_ahead.AHEAD_AT` of its chunks (at most one step ahead, within `window`)."""
        mine = SliceFetch(version)
        holders = _holders(runs, model, version, resolved, index, deadline)
        layout_i = layout_of(parts[index])
        specs = {spec.name: spec for spec in layout_i.tensors}
        running: list[tuple[slice_ahead.Step, Future[SliceFetch], list[_Copy], int]] = []

        def settle() -> None:
            """Wait for the oldest step in flight; count its blocks' parts as in place."""
            _, future, copies, size = running.pop(0)
            try:
                _merge(mine, future.result())
            finally:
                window.give(size)
            with lock:
                for c in copies:
                    left[c.name] -= 1
                    if left[c.name] == 0:
                        done.add(c.name)
                layouts.settle(dest, done)

        with ThreadPoolExecutor(2, thread_name_prefix="slices-step") as ahead:
            try:
                for copies in pipelines[index]:
                    if stop.event.is_set():  # another step failed: the read fails with it
                        break
                    needed = _needed(copies, layout_i, specs)
                    size = len(needed) * layout_i.chunk_size
                    on_gpu = _staging_device([slices[c.name].tensor for c in copies]).type
                    before = running[-1][0] if running else None
                    if before is not None:
                        before.wait_go(deadline)
                        if on_gpu == "cuda" or before.ended or not window.try_take(size):
                            settle()  # not ahead: after the step before, as it fits
                            before = None
                    if before is None:
                        window.take(size)
                    step = slice_ahead.Step(needed, before, stop)
                    running.append(
                        (step, ahead.submit(read, index, holders, copies, step), copies, size)
                    )
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
        _merge(result, future.result())


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


def _merge(result: SliceFetch, part: SliceFetch) -> None:
    """Add what one source shard's pipeline read to `result`."""
    moved = FetchStats()
    moved.bytes_per_source.update(part.bytes_per_source)
    moved.chunks = part.chunks
    moved.failed_sources.update(part.failed_sources)
    moved.slow_sources.update(part.slow_sources)
    add_moved(result, moved)


def _steps(
    plan: Mapping[int, list[_Copy]], blocks: layouts.BlockSet
) -> list[dict[int, list[_Copy]]]:
    """`plan` in steps of whole blocks, in the block set's order (that of its chunks), each
    of about 1/`layouts.PIPELINE_STEPS` of the blocks' bytes (at most `STAGING_BUDGET`; a
    block larger than that, alone): the block set's chunks complete about in its order (each
    served as its bytes are in place: `slice_fill`), the order the readers chained behind
    this one ask for them in."""
    sizes = {spec.name: spec.nbytes for spec in blocks.layout.tensors}
    total = sum(sizes.values())
    budget = min(STAGING_BUDGET, max(blocks.layout.chunk_size, total // layouts.PIPELINE_STEPS))
    wanted = {c.name for copies in plan.values() for c in copies}
    groups: list[set[str]] = [set()]
    size = 0
    for spec in blocks.layout.tensors:
        if spec.name not in wanted:
            continue
        if groups[-1] and size + sizes[spec.name] > budget:
            groups.append(set())
            size = 0
        groups[-1].add(spec.name)
        size += sizes[spec.name]
    steps = []
    for group in groups:
        step = {
            index: [c for c in copies if c.name in group] for index, copies in sorted(plan.items())
        }
        steps.append({index: copies for index, copies in step.items() if copies})
    return [step for step in steps if step]


def _from_holders(
    peers: layouts.LayoutPeers,
    me: Identity,
    model: str,
    version: int,
    layout: str,
    cover: Sequence[str],
    blocks: layouts.BlockSet,
    held: layouts.Holding,
    slices: Mapping[str, Slice],
    token: RenewingToken,
    deadline: Deadline,
    rate_floor: float,
    result: SliceFetch,
) -> list[int]:
    """Read the blocks into `dest` from the holders of the same blocks, then from the block
    sets of the `cover` layouts; the blocks neither gave go into `result.from_trainer`.
    Returns the checksums recorded for the block set (empty: none yet)."""
    peer = layouts.read_from_peers(
        peers, me, model, version, layout, blocks, held, token, deadline, rate_floor
    )
    add_moved(result, peer.stats)
    if peer.published:
        result.publisher_checked += peer.stats.chunks
    missing = set(peer.missing_blocks)
    for other in cover:
        if not missing:
            break
        moved = FetchStats()
        covered = layout_cover.read_from_cover(
            peers, me, model, version, other, slices, missing, token, deadline, moved,
            blocks.layout.chunk_size, rate_floor,
        )  # fmt: skip
        missing -= covered.names
        result.publisher_checked += covered.publisher_checked
        add_moved(result, moved)
    result.from_trainer = missing
    return peer.sums


def _renewing_token(
    runs: Orchestrator, model: str, version: int, resolved: pb.ResolveResponse, deadline: Deadline
) -> RenewingToken:
    """The read token of a layout read from peers (model@version's, as for the trainer's
    shards), renewed before it expires by a Resolve without the manifest."""

    def renew() -> tuple[bytes, int]:
        again = runs.holders(model, version, None, deadline)
        return bytes(again.read_token), int(again.token_expiry_unix)

    return RenewingToken(bytes(resolved.read_token), int(resolved.token_expiry_unix), renew)


def _unpin(
    pins: Pins, me: Identity, model: str, version: int, pin_id: str, deadline: Deadline
) -> None:
    """Drop our pin within the deadline; one that does not fit is left to the lease."""
    budget = deadline.finish(me.timeout)
    try:
        if budget is None:
            raise DeadlineExceeded("no time left before the deadline")
        pins.unpin(model, version, pin_id, budget)
    except TensorHubError as exc:
        log.warning(
            "unpin of %s@%d not done (%s): the pin is left to the session's lease "
            "(it goes at close(), or when the lease expires)", model, version, exc,
        )  # fmt: skip


def _read_part(
    me: Identity,
    runs: Orchestrator,
    model: str,
    version: int,
    shard: int | None,
    holders: pb.ResolveResponse,
    manifest: pb.Manifest,
    copies: list[_Copy],
    slices: Mapping[str, Slice],
    deadline: Deadline,
    result: SliceFetch,
    rate_floor: float,
    progress: ProgressCallback | None,
    deltas: DeltaReader | None = None,
    carry: Carry | None = None,
    gpu: threading.Lock | None = None,
    fill: slice_fill.Fill | None = None,
    step: slice_ahead.Step | None = None,
    budget: int | None = None,
    parallel: int = DEFAULT_PARALLEL,
) -> None:
    """Fetch the chunks of one source shard that `copies` need (and only those: the others
    of the staging copy stay missing), then copy the intersections out, in place. With
    `carry` (a layout reader's steps), the chunks a step before read are copied from it,
    not read again, and those a later step needs are kept for it (`ros.client.slice_carry`).
    With `fill` (a layout reader's), each chunk's intersections are copied out as it is
    verified, and the block set's chunks served as their bytes are in place.
    `gpu`, held while a staging copy in GPU memory is in use, keeps reads that run at once
    to one such copy at a time (the layout steps' pipelines: `_read_steps`). `step` (a
    layout reader's) is told what each round asks for and what lands, so that the next
    step can ask for its own before this one has arrived (`ros.client.slice_ahead`).

    The staging copy lives where the destinations are (`_staging_device`): for slices in GPU
    memory it is on their device, so the bytes take the transports' path into GPU memory
    (as `fetch(into=...)`: IPC, or TCP -> pinned buffer -> device) and each intersection
    is copied device to device, strided, into the slice's own memory; nothing goes back
    through host memory and no tensor in GPU memory is viewed as numpy."""
    layout = layout_of(manifest)
    specs = {s.name: s for s in layout.tensors}
    groups = _staging_groups(copies, layout, specs, budget) if deltas is None else [copies]
    for n, group in enumerate(groups):  # one staging copy at a time (`STAGING_BUDGET`)
        _read_group(
            me, runs, model, version, shard, holders, manifest, layout, specs, group,
            slices, deadline, result, rate_floor, progress, deltas, carry, gpu, fill,
            step, n == len(groups) - 1, parallel,
        )  # fmt: skip
        give_back_freed()  # its staging, freed as it returned: resident no more


def _read_group(
    me: Identity,
    runs: Orchestrator,
    model: str,
    version: int,
    shard: int | None,
    holders: pb.ResolveResponse,
    manifest: pb.Manifest,
    layout: Layout,
    specs: Mapping[str, TensorSpec],
    copies: list[_Copy],
    slices: Mapping[str, Slice],
    deadline: Deadline,
    result: SliceFetch,
    rate_floor: float,
    progress: ProgressCallback | None,
    deltas: DeltaReader | None,
    carry: Carry | None,
    gpu: threading.Lock | None = None,
    fill: slice_fill.Fill | None = None,
    step: slice_ahead.Step | None = None,
    last: bool = True,
    parallel: int = DEFAULT_PARALLEL,
) -> None:
    """`_read_part` for one staging copy: the chunks `copies` need, into a staging copy of
    the shard's `layout` allocated here (or the delta base kept from the last call), then
    the intersections copied out. With `step` (`last`: the step's last staging copy), the
    chunks the step in flight before it reads too are not asked for: they are taken from
    `carry` once that step ended (`slice_ahead.Step.later`)."""
    device = _staging_device([slices[c.name].tensor for c in copies])
    with _gpu_slot(gpu if device.type == "cuda" else None, deadline):
        needed = _needed(copies, layout, specs)
        base = deltas.staged.take(model, shard) if deltas is not None else None
        if base is not None and not _fits(base, layout, needed, device):
            base.drop()
            base = None
        tensors = base.tensors if base is not None else _allocate_staging(
            layout, device, model, version, shard
        )  # fmt: skip
        filling = None if fill is None else fill.staging(layout, tensors, copies)
        staging = filling or HeldVersion.reader(me.tenant, model, version, layout, tensors)
        applied = None
        if deltas is not None and base is not None and manifest.HasField("delta"):
            applied = deltas.apply(
                model, shard, manifest, staging, base.version, deadline, needed, hold=False
            )
            result.deltas[shard] = applied.stats
        if carry is not None:
            carry.restore(shard, staging, needed)
        missing = [i for i in sorted(needed) if not staging.is_present(i)]
        later = step.later(missing) if step is not None and carry is not None else set()
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
            if carry is None or ask:
                stats = runs.run(
                    target, holders, deadline, rate_floor=rate_floor, progress=progress,
                    landed=landed, stop=stop, parallel=parallel,
                )  # fmt: skip
            if later and step is not None and carry is not None:  # read by the step before
                step.wait_before(deadline)
                carry.restore(shard, staging, later)
                rest = [i for i in later if not staging.is_present(i)]
                if rest:  # not kept for us (never: `Carry.plan` counts every step)
                    again = Target(model, version, shard, staging, manifest, rest, False)
                    more = runs.run(
                        again, holders, deadline, rate_floor=rate_floor, stop=stop,
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
        if fill is None or filling is None:
            _copy_parts(copies, staging.tensors, slices)
        else:  # copied out as each chunk was verified
            fill.finish(filling, needed, copies)
        if carry is not None:
            carry.keep(shard, staging, needed)


@contextmanager
def _gpu_slot(gpu: threading.Lock | None, deadline: Deadline) -> Iterator[None]:
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


def _needed(copies: Sequence[_Copy], layout: Layout, specs: Mapping[str, TensorSpec]) -> set[int]:
    """The chunks of a source shard's `layout` that hold the parts `copies` take."""
    needed: set[int] = set()
    for c in copies:
        spec = specs[c.name]
        first, end = byte_span(c.source, c.part, torch_dtype(spec.dtype).itemsize)
        needed.update(chunks_for(layout, spec, first, end))
    return needed


def _staging_groups(
    copies: Sequence[_Copy],
    layout: Layout,
    specs: Mapping[str, TensorSpec],
    budget: int | None = None,
) -> list[list[_Copy]]:
    """`copies` in groups whose chunks of the source shard add up to at most `budget`
    bytes (None: `STAGING_BUDGET`; a copy whose own chunks exceed it, alone), in order: a
    read without deltas stages one group at a time, so its peak extra memory is one group's
    chunks, not every chunk of the shard its slices touch."""
    limit = STAGING_BUDGET if budget is None else budget
    groups: list[list[_Copy]] = [[]]
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


def _fits(base: Staged, layout: Layout, needed: set[int], device: torch.device) -> bool:
    """Whether a kept staging copy can be the base of this read: the same layout, on the
    same device, holding every chunk this read needs."""
    first = next(iter(base.tensors.values()), None)
    on = first.device if first is not None else torch.device("cpu")
    return base.layout == layout and needed <= base.filled and on.type == device.type


def _staging_device(destinations: Sequence[torch.Tensor]) -> torch.device:
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


def _copy_parts(
    copies: Sequence[_Copy], sources: Mapping[str, torch.Tensor], slices: Mapping[str, Slice]
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


def _plan(
    model: str, version: int, parts: list[pb.Manifest], slices: Mapping[str, Slice]
) -> dict[int, list[_Copy]]:
    """Which blocks to copy from which source shard, each slice covered exactly once: the
    blocks of a split tensor add up to it; a whole (replicated) one is read from one shard."""
    plan: dict[int, list[_Copy]] = {}
    entries = [{e.name: e for e in manifest.tensors} for manifest in parts]
    for name, want in slices.items():
        box = want.box
        covered = 0
        known = False
        for index, by_name in enumerate(entries):
            entry = by_name.get(name)
            if entry is None:
                continue
            known = True
            glob, held = placement_of(entry)
            _check_slice(model, version, name, want, entry, glob)
            common = held.intersect(box)
            if covered >= box.volume or common is None or common.volume == 0:
                continue
            plan.setdefault(index, []).append(_Copy(name, held, common))
            covered += common.volume
        if not known:
            raise InvalidArgument(f"{model}@{version} has no tensor {name!r}")
        if covered != box.volume:
            raise InvalidArgument(
                f"{name!r}: the shards of {model}@{version} cover {covered} of the "
                f"{box.volume} elements asked for (overlapping or missing blocks)"
            )
    return plan


def _check_slice(
    model: str,
    version: int,
    name: str,
    want: Slice,
    entry: pb.TensorEntry,
    glob: tuple[int, ...],
) -> None:
    if tuple(int(d) for d in want.global_shape) != glob:
        raise InvalidArgument(
            f"{name!r}: global shape {tuple(want.global_shape)} asked, {model}@{version} has {glob}"
        )
    if dtype_name(want.tensor.dtype) != entry.dtype:
        raise InvalidArgument(f"{name!r}: dtype {want.tensor.dtype}, published {entry.dtype}")
    if not want.box.within(glob):
        raise InvalidArgument(f"{name!r}: block {want.box} is outside the global shape {glob}")
