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

from ros.client import layout_cover, layout_delta, layouts, slice_fill, slice_staging
from ros.client.deadline import Deadline
from ros.client.delta_fetch import DeltaReader
from ros.client.identity import Identity
from ros.client.orchestrator import Orchestrator, ProgressCallback
from ros.client.read_token import RenewingToken
from ros.client.slice import Slice
from ros.client.slice_fetch import SliceFetch
from ros.client.slice_plan import Copy, plan_copies, shard_of
from ros.client.slice_read import read_sources, read_steps
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from transport.outcome import FetchStats, add_moved

log = logging.getLogger(__name__)


def read_layout(
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
    blocks (`read_steps`: each chunk served as soon as its bytes are in place), then register
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
                runs, me.tenant, model, version, parts, lambda i: shard_of(resolved, i), slices,
                blocks, dest, rate_floor,
            )  # fmt: skip
            applied = layout_delta.apply_deltas(
                read, plan_copies(model, version, parts, slices), base, list(held.found.block_sums),
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
        plan = plan_copies(model, version, parts, todo) if todo else {}
        published = list(held.found.publisher_sums)
        fill = slice_fill.Fill(
            dest, {name: want.box for name, want in todo.items()}, todo,
            published if len(published) == blocks.layout.num_chunks else None,
        )  # fmt: skip
        read_steps(
            runs, me, model, version, resolved, parts, _steps(plan, blocks), slices, dest,
            done, deadline, result, rate_floor, progress, fill,
        )  # fmt: skip
        _read_failed_whole(
            runs, me, model, version, resolved, parts, slices, fill, deadline, result, rate_floor
        )
        result.served = layouts.finish_holding(
            peers, me, model, version, layout, blocks, dest, recorded, deadline
        )
        if deltas is not None and result.served:
            deltas.layout_bases.remember(model, blocks, version, dest)
    except BaseException:
        layouts.release(peers, me, model, version, layouts.cleanup_time(me, deadline))
        raise


def _read_failed_whole(
    runs: Orchestrator,
    me: Identity,
    model: str,
    version: int,
    resolved: pb.ResolveResponse,
    parts: list[pb.Manifest],
    slices: Mapping[str, Slice],
    fill: slice_fill.Fill,
    deadline: Deadline,
    result: SliceFetch,
    rate_floor: float,
) -> None:
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
        "publisher's wsum64; reading their blocks in whole chunks", model, version, len(failed),
    )  # fmt: skip
    dest_layout = fill.layout
    names = {
        dest_layout.tensors[seg.tensor].name for at in failed for seg in dest_layout.segments(at)
    }
    todo = {name: slices[name] for name in sorted(names) if name in slices}
    plan = plan_copies(model, version, parts, todo)
    read_sources(
        me, runs, model, version, resolved, parts, plan, todo, deadline, result, rate_floor,
        None, None,
    )  # fmt: skip
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
