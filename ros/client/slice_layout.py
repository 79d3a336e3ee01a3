"""A reader of slices that names its layout (`ros.client.slices`, `layout=`): it holds and
serves its blocks (`ros.client.layouts`), reads them first from the holders of the same
blocks and from the block sets of the `cover` layouts, and only the rest from the trainer's
shards, in steps of whole blocks (`_steps`, read by `slice_read.read_steps`); with deltas,
blocks it held at an earlier version first get the changes that fall inside them
(`ros.client.layout_delta`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import replace

from ros.client import layout_cover, layout_delta, layouts, slice_fill, slice_staging
from ros.client.delta_fetch import DeltaReader
from ros.client.read_token import RenewingToken
from ros.client.slice_fetch import SliceFetch
from ros.client.slice_plan import Copy, SliceRead
from ros.client.slice_read import read_sources, read_steps
from transport.outcome import FetchStats, add_moved

log = logging.getLogger(__name__)


def read_layout(
    read: SliceRead,
    peers: layouts.LayoutPeers,
    layout: str,
    cover: Sequence[str],
    blocks: layouts.BlockSet,
    result: SliceFetch,
    deltas: DeltaReader | None = None,
) -> None:
    """A reader in a layout (`ros.client.layouts`): serve the blocks as a PARTIAL holder
    (a registration that also pins the version), read them from the holders registered
    before us and the `cover` layouts, the rest from the trainer's shards in steps of whole
    blocks (`read_steps`: each chunk served as soon as its bytes are in place), then register
    COMPLETE (which drops the pin). A failure stops the serving and deletes our record
    and its pin. With `deltas`, blocks that hold the version remembered for them first
    get the changes that fall inside them (`ros.client.layout_delta`), and the blocks
    served at the end are remembered as the base of the next read."""
    runs, me, model, version = read.runs, read.me, read.model, read.version
    slices, deadline = read.slices, read.deadline
    token = _renewing_token(read)
    base = deltas.layout_bases.take(model, blocks) if deltas is not None else None
    holder = layouts.LayoutRead(peers, me, model, version, layout, blocks, deadline)
    held = layouts.start_holding(holder)
    dest = held.dest
    try:
        if base is not None:
            block_read = layout_delta.BlockRead(
                runs, me.tenant, model, version, read.parts, read.shard_of, slices, blocks,
                dest, read.rate_floor,
            )  # fmt: skip
            applied = layout_delta.apply_deltas(
                block_read, read.plan(slices), base, list(held.found.block_sums),
                list(held.found.publisher_sums), deadline,
            )  # fmt: skip
            result.deltas.update(applied.stats)
            add_moved(result, applied.moved)
        recorded = _from_holders(read, holder, cover, held, token, result)
        done = set(slices) - result.from_trainer
        layouts.settle(dest, done)
        todo = {name: slices[name] for name in sorted(result.from_trainer)}
        plan = read.plan(todo) if todo else {}
        published = list(held.found.publisher_sums)
        fill = slice_fill.Fill(
            dest, {name: want.box for name, want in todo.items()}, todo,
            published if len(published) == blocks.layout.num_chunks else None,
        )  # fmt: skip
        read_steps(read, _steps(plan, blocks), dest, done, result, fill)
        _read_failed_whole(read, fill, result)
        result.served = layouts.finish_holding(holder, dest, recorded)
        if deltas is not None and result.served:
            deltas.layout_bases.remember(model, blocks, version, dest)
    except BaseException:
        layouts.release(peers, me, model, version, layouts.cleanup_time(me, deadline))
        raise


def _read_failed_whole(read: SliceRead, fill: slice_fill.Fill, result: SliceFetch) -> None:
    """The chunks of the block set that failed the publisher's check (written from byte
    ranges that were not the publisher's): the blocks they touch are read again from the
    trainer's shards in whole chunks, each checked against the manifest, and each such
    chunk is checked again (`Fill.reverify`: `IntegrityError` if it still differs). Every
    fallback and failure is named in `result.range_failures`."""
    result.range_failures.extend(fill.notes)
    failed = fill.unverified()
    if not failed:
        return
    log.warning(
        "%s@%d: %d chunks of the block set written from byte ranges differ from the "
        "publisher's wsum64; reading their blocks in whole chunks", read.model, read.version,
        len(failed),
    )  # fmt: skip
    dest_layout = fill.layout
    names = {
        dest_layout.tensors[seg.tensor].name for at in failed for seg in dest_layout.segments(at)
    }
    todo = {name: read.slices[name] for name in sorted(names) if name in read.slices}
    read_sources(replace(read, progress=None), read.plan(todo), result, None)
    result.range_failures.extend(fill.reverify().values())


def _steps(plan: Mapping[int, list[Copy]], blocks: layouts.BlockSet) -> list[dict[int, list[Copy]]]:
    """`plan` in steps of whole blocks, in the block set's order (that of its chunks), each
    of about 1/`layouts.PIPELINE_STEPS` of the blocks' bytes (at most `STAGING_BUDGET`; a
    block larger than that, alone): the block set's chunks complete about in its order (each
    served as its bytes are in place: `slice_fill`), the order the readers chained behind
    this one ask for them in."""
    sizes = {spec.name: spec.nbytes for spec in blocks.layout.tensors}
    total = sum(sizes.values())
    budget = min(
        slice_staging.STAGING_BUDGET, max(blocks.layout.chunk_size, total // layouts.PIPELINE_STEPS)
    )
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
    read: SliceRead,
    holder: layouts.LayoutRead,
    cover: Sequence[str],
    held: layouts.Holding,
    token: RenewingToken,
    result: SliceFetch,
) -> list[int]:
    """Read the blocks into `held.dest` from the holders of the same blocks, then from the
    block sets of the `cover` layouts; the blocks neither gave go into
    `result.from_trainer`. Returns the checksums recorded for the block set (empty: none
    yet)."""
    peer = layouts.read_from_peers(holder, held, token, read.rate_floor)
    add_moved(result, peer.stats)
    if peer.published:
        result.publisher_checked += peer.stats.chunks
    missing = set(peer.missing_blocks)
    for other in cover:
        if not missing:
            break
        moved = FetchStats()
        covered = layout_cover.read_from_cover(
            read, holder.peers, other, missing, token, moved, holder.blocks.layout.chunk_size
        )
        missing -= covered.names
        result.publisher_checked += covered.publisher_checked
        add_moved(result, moved)
    result.from_trainer = missing
    return peer.sums


def _renewing_token(read: SliceRead) -> RenewingToken:
    """The read token of a layout read from peers (model@version's, as for the trainer's
    shards), renewed before it expires by a Resolve without the manifest."""

    def renew() -> tuple[bytes, int]:
        again = read.runs.holders(read.model, read.version, None, read.deadline)
        return bytes(again.read_token), int(again.token_expiry_unix)

    resolved = read.resolved
    return RenewingToken(bytes(resolved.read_token), int(resolved.token_expiry_unix), renew)
