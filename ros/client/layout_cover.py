"""A reader in one layout covered by another layout's holders (docs/design-notes.md, "Readers
in another layout"): a TP-1 reader takes each tensor from the blocks of two TP-2 workers.

`fetch_slices(layout=..., cover=("tp2",))` asks the hub for the block sets of each layout it
names (`ResolveLayoutCover`: their descriptions, recorded checksums, the publisher's
checksums where their layout was declared before the version's publish, and a few holders
of each), plans which of its blocks those block sets cover exactly, and reads, from each
block set's holders, only the chunks of that block set's own layout that contain the parts
it needs, into a staging copy of it (the peak extra memory is one block set). Each chunk is
checked against the publisher's wsum64 of it where the answer has one for every chunk,
else against the block set's recorded checksums (its first COMPLETE reader's). A block is
filled from the cover only when every part of it arrived; the others are left to the
trainer's shards.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ros.client.layouts import PEER_ROUNDS, LayoutPeers, sources_of
from ros.client.read_token import RenewingToken
from ros.client.slice import Slice
from ros.client.slice_plan import SliceRead
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from tensorhub.checksum_kinds import WSUM64, XXH3
from tensorhub.errors import InvalidArgument
from transport.boxes import Box, byte_span, chunks_for
from transport.layout import Layout, dtype_name, torch_dtype
from transport.outcome import FetchStats
from transport.store import HeldVersion

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Described:
    """A block set of the covering layout: its layout, the box of each of its blocks (by
    global tensor name), what each of its chunks is checked against (`expected`, of
    `checksum`'s kind) and its holders."""

    id: str
    layout: Layout
    boxes: dict[str, tuple[str, tuple[int, ...], Box]]  # name -> (dtype, global shape, box)
    expected: list[int]
    checksum: str  # WSUM64: the publisher's checksums; XXH3: the record's
    holders: list[pb.Holder]


@dataclass
class Covered:
    """What a cover filled: the blocks (by name) and how many of the chunks read for them
    were checked against the publisher's checksums (the rest against the records')."""

    names: set[str]
    publisher_checked: int = 0


@dataclass(frozen=True)
class _Part:
    name: str
    source: Box  # the block the block set holds
    part: Box  # the intersection to copy


def _parse(answer: pb.LayoutBlockSet, chunk_size: int) -> _Described | None:
    """The block set an answer describes, in chunks of `chunk_size` (the version's), checked
    against the publisher's checksums where the answer has them for every chunk, else
    against the record's; None (logged) when it cannot be read: malformed, another chunk
    size, a block outside its global tensor, recorded checksums that do not match its
    chunks."""
    try:
        data: Any = json.loads(bytes(answer.blocks))
        if int(data["chunk_size"]) != chunk_size:
            raise ValueError(f"chunk size {data['chunk_size']}, the version's is {chunk_size}")
        boxes: dict[str, tuple[str, tuple[int, ...], Box]] = {}
        meta: dict[str, torch.Tensor] = {}
        for name, dtype, glob, offsets, shape in sorted(data["blocks"]):
            box = Box(tuple(int(o) for o in offsets), tuple(int(s) for s in shape))
            extent = tuple(int(g) for g in glob)
            if not box.within(extent):
                raise ValueError(f"block {box} of {name!r} is outside {extent}")
            boxes[str(name)] = (str(dtype), extent, box)
            meta[str(name)] = torch.empty(box.shape, dtype=torch_dtype(str(dtype)), device="meta")
        layout = Layout.from_tensors(meta, chunk_size=chunk_size)  # as its holders built it
    except (KeyError, TypeError, ValueError, InvalidArgument) as exc:
        log.warning("block set %s: unreadable description (%s); not read", answer.block_set, exc)
        return None
    sums, published = list(answer.block_sums), list(answer.publisher_sums)
    if len(sums) != layout.num_chunks:
        return None
    holders = list(answer.holders)
    if len(published) == layout.num_chunks:
        return _Described(answer.block_set, layout, boxes, published, WSUM64, holders)
    return _Described(answer.block_set, layout, boxes, sums, XXH3, holders)


def _plan(
    sets: list[_Described], slices: Mapping[str, Slice], todo: set[str]
) -> dict[str, list[tuple[_Described, _Part]]]:
    """Per block of `todo`, the parts the block sets cover it with, when they cover it
    exactly (the blocks of a split tensor add up to it; a whole one is read from one)."""
    plan: dict[str, list[tuple[_Described, _Part]]] = {}
    for name in sorted(todo):
        want = slices[name]
        box, covered, parts = want.box, 0, []
        glob = tuple(int(d) for d in want.global_shape)
        for s in sets:
            held = s.boxes.get(name)
            if held is None or held[0] != dtype_name(want.tensor.dtype) or held[1] != glob:
                continue
            common = held[2].intersect(box)
            if covered >= box.volume or common is None or common.volume == 0:
                continue
            parts.append((s, _Part(name, held[2], common)))
            covered += common.volume
        if parts and covered == box.volume:
            plan[name] = parts
    return plan


def read_from_cover(
    read: SliceRead,
    peers: LayoutPeers,
    layout: str,
    todo: set[str],
    token: RenewingToken,
    stats: FetchStats,
    chunk_size: int,
) -> Covered:
    """Fill the blocks of `todo` (of `read`'s slices) that `layout`'s block sets (in the
    version's `chunk_size`) cover from their holders (module docstring); what it filled."""
    me = read.me
    request = pb.ResolveLayoutCoverRequest(
        model=read.model, version=read.version, layout=layout, holder=me.holder_name,
        topology=me.topology.labels(),
    )  # fmt: skip
    answer = peers.rpc("ResolveLayoutCover", request, read.deadline.work(me.timeout))
    parsed = (_parse(a, chunk_size) for a in answer.block_sets)
    sets = [d for d in parsed if d is not None and d.holders]
    plan = _plan(sets, read.slices, todo)
    by_set: dict[str, list[_Part]] = {}
    described = {d.id: d for d in sets}
    for covering in plan.values():
        for d, part in covering:
            by_set.setdefault(d.id, []).append(part)
    arrived: set[tuple[str, str]] = set()
    checked = 0
    for set_id, needed in by_set.items():
        covering_set = described[set_id]
        before = stats.chunks
        got = _read_set(read, peers, covering_set, needed, token, stats)
        if covering_set.checksum == WSUM64:
            checked += stats.chunks - before
        arrived.update((set_id, name) for name in got)
    filled = {
        name for name, covering in plan.items() if all((d.id, name) in arrived for d, _ in covering)
    }
    return Covered(filled, checked)


def _read_set(
    read: SliceRead,
    peers: LayoutPeers,
    s: _Described,
    parts: list[_Part],
    token: RenewingToken,
    stats: FetchStats,
) -> set[str]:
    """Read the chunks of block set `s` that `parts` need into a staging copy of its layout,
    from its holders (dropping one that fails or sends bad bytes, `PEER_ROUNDS` rounds at
    most), and copy every part whose chunks all arrived; the names of the parts copied."""
    me, model, version = read.me, read.model, read.version
    specs = {spec.name: spec for spec in s.layout.tensors}
    needs: dict[str, set[int]] = {}
    for p in parts:
        spec = specs[p.name]
        first, end = byte_span(p.source, p.part, torch_dtype(spec.dtype).itemsize)
        needs.setdefault(p.name, set()).update(chunks_for(s.layout, spec, first, end))
    wanted = sorted(set().union(*needs.values()))
    staging = HeldVersion.reader(me.tenant, model, version, s.layout, s.layout.allocate())
    suspects: dict[str, BaseException] = {}
    for _ in range(PEER_ROUNDS):
        sources = sources_of(s.holders, suspects)
        if not sources:
            break
        done = peers.read(
            me.tenant, model, version, s.layout, staging, sources, token=token,
            deadline=read.deadline.work_end, me=me.topology, chunks=wanted,
            expected=s.expected, checksum=s.checksum, tls=me.tls, stats=stats,
            readers=peers.readers, rate_floor=read.rate_floor,
        )  # fmt: skip
        suspects.update(done.failures)
        if done.done:
            break
    for name, exc in suspects.items():
        stats.failed_sources.setdefault(name, f"{type(exc).__name__}: {exc}")
    copied = set()
    for p in parts:
        if not all(staging.is_present(i) for i in needs[p.name]):
            continue
        want = read.slices[p.name]
        dest = want.tensor.detach()[p.part.slices_in(want.box)]
        dest.copy_(staging.tensors[p.name][p.part.slices_in(p.source)])
        copied.add(p.name)
    return copied
