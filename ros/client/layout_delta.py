"""Deltas for layout holders: a reader in a layout whose blocks hold version u reads only
v's changes that fall inside them (`Hub.fetch_slices(layout=..., delta=True)`;
docs/design-notes.md, "Deltas for layout holders").

A layout reader with `delta=True` that registered COMPLETE for u remembers, per block set,
u and the xxh3-64 of each chunk of its block set's layout (`LayoutBases`: derived from
bytes verified against the publisher, and equal to the block set's record). When it
fetches v, published with a delta against u, before it reads from peers or the trainer
(`apply_deltas`, a step of the same fetch, under its one `Deadline`):

1. **Plan.** For each source shard, the trainer chunks that hold parts of its blocks. A
   block is applied from the delta only when every such chunk, of every source shard, is
   encoded (a chunk sent whole, a shard without a delta against u, or a chain: its blocks
   are read whole, from the block set's holders or the trainer, as without delta). When
   the encoded chunks those blocks need come to more than `WORTH` of the blocks' own bytes
   (a step that changes most words), every block is read whole.
2. **Check the base.** Each chunk of the block set's layout whose blocks are all to be
   applied must hold exactly u: its xxh3-64 is the one remembered for u. A chunk that
   differs (memory changed between the fetches) is counted (`DeltaStats.base_mismatch`)
   and left missing: it is read whole.
3. **Read the encoded chunks** of the trainer chunks the checked chunks' blocks need, from
   the companion version (`{model}.delta`@v, of the same shard) as targets of the fetch's
   `Orchestrator` (unheld: from the trainer and every client that holds the companion),
   in groups of at most `STAGING_BUDGET` encoded bytes, each checked against the
   companion manifest's checksums by the transport and against the encoded digest of v's
   manifest before it is decoded, within the first half of the work time left.
4. **Apply**: each changed byte of a trainer chunk that lies inside a block is XORed into
   the block's own memory, in place (no staging of the trainer's chunks).
5. **Mark present** each checked chunk whose blocks got every change, with its xxh3-64
   computed over the result (when the block set of v already has recorded checksums, the
   result must equal them too, and when its layout was declared before v's publish, the
   result's wsum64 must equal the publisher's); from then on it is served. The rest stays
   missing, and the fetch reads it as it reads a layout without delta.

Why the bytes are v's: the base is u's (checked against sums derived from publisher-verified
bytes), and the changes are the publisher's (the companion's chunks checked against the
checksums the publisher's ranks computed, each encoded chunk against v's manifest). Their
XOR is v, as the publisher stated it. Anything that stops the delta (no companion holder,
a companion of the wrong size, the deadline of its part, a chunk that fails a check) leaves
those chunks missing for the rounds that follow: slower, never wrong.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from ros.cli.rss import give_back_freed
from ros.client.block_xor import Part, apply_chunk
from ros.client.deadline import Deadline
from ros.client.delta_chunks import check_companion, companion_bytes
from ros.client.delta_stats import DeltaStats
from ros.client.layouts import BlockSet
from ros.client.manifest import layout_of
from ros.client.orchestrator import Orchestrator, Target, manifest_of_shard
from ros.client.slice import Slice
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from tensorhub.checksum_kinds import WSUM64, XXH3
from tensorhub.delta_rules import ENCODINGS, TENSOR
from tensorhub.errors import TensorHubError
from transport import delta as codec
from transport.boxes import byte_span, chunks_for
from transport.layout import Layout, TensorSpec, torch_dtype
from transport.outcome import FetchStats, add_moved
from transport.pace import DEFAULT_RATE_FLOOR
from transport.store import HeldVersion

log = logging.getLogger(__name__)

STAGING_BUDGET = 64 * 1024 * 1024
"""Encoded bytes of a companion staged at once: its chunks are read in groups of at most
this (with the companion chunks they lie in), each group freed once applied."""

COMPANION_SHARE = 0.5  # of the work time left: the most the companions' reads may take

WORTH = 0.5
"""The most encoded bytes a block set's delta may read, as a share of the blocks it makes
(`_not_worth`); past it every block is read whole."""


@dataclass(frozen=True)
class LayoutBase:
    """What a layout reader's blocks held when it last registered COMPLETE: the version,
    the xxh3-64 of each chunk of its block set's layout, and where the blocks were."""

    version: int
    sums: tuple[int, ...]
    where: tuple[tuple[str, str, int], ...]


def _where(blocks: BlockSet) -> tuple[tuple[str, str, int], ...]:
    return tuple((n, str(t.device), t.data_ptr()) for n, t in blocks.tensors.items())


class LayoutBases:
    """The bases of a client's layout reads with `delta=True`, per (model, block set).
    Thread-safe."""

    def __init__(self) -> None:
        self._bases: dict[tuple[str, str], LayoutBase] = {}
        self._lock = threading.Lock()

    def remember(self, model: str, blocks: BlockSet, version: int, dest: HeldVersion) -> None:
        """`dest` (the blocks of model@version, every chunk present and verified) is the
        base of the next delta read of these blocks."""
        sums = tuple(dest.checksum(i) for i in range(blocks.layout.num_chunks))
        with self._lock:
            self._bases[(model, blocks.id)] = LayoutBase(version, sums, _where(blocks))

    def take(self, model: str, blocks: BlockSet) -> LayoutBase | None:
        """The base remembered for these blocks in this memory, forgotten (the read that
        takes it writes the memory; it remembers the next one when it completes)."""
        with self._lock:
            base = self._bases.pop((model, blocks.id), None)
        return base if base is not None and base.where == _where(blocks) else None

    def drop(self, model: str | None = None) -> None:
        with self._lock:
            for key in [k for k in self._bases if model is None or k[0] == model]:
                del self._bases[key]


@dataclass(frozen=True)
class BlockRead:
    """The layout reader's fetch that `apply_deltas` is a step of: model@`version` for
    `tenant`, its source shards' manifests (`parts`; `shard_of` an index's shard, None for
    a version published whole), the blocks it reads (`slices`, `blocks`) into `dest`, and
    the fetch's `Orchestrator` and rate floor."""

    runs: Orchestrator
    tenant: str
    model: str
    version: int
    parts: Sequence[pb.Manifest]
    shard_of: Callable[[int], int | None]
    slices: Mapping[str, Slice]
    blocks: BlockSet
    dest: HeldVersion
    rate_floor: float = DEFAULT_RATE_FLOOR


@dataclass
class BlockDelta:
    """What `apply_deltas` did: per source shard read (None: a version published whole),
    its `DeltaStats`; and what the companions' reads moved."""

    stats: dict[int | None, DeltaStats] = field(default_factory=dict)
    moved: FetchStats = field(default_factory=FetchStats)


def apply_deltas(
    read: BlockRead,
    plan: Mapping[int, Sequence[Part]],
    base: LayoutBase,
    recorded: Sequence[int],
    published: Sequence[int],
    deadline: Deadline,
) -> BlockDelta:
    """Make what chunks of `dest` (the blocks' memory, holding `base`) it can into
    model@`version`'s from the deltas of the source shards (`parts`, read as `plan` says),
    and mark them present (module docstring); `recorded`: the block set's checksums for
    `version` when it has them (else empty); `published`: the publisher's wsum64 of them
    (a layout declared before `version`'s publish; else empty). Never raises for a delta
    that cannot be used: the reason is in the stats, and those chunks stay missing."""
    out = BlockDelta()
    for index in plan:
        out.stats[read.shard_of(index)] = DeltaStats(base=base.version)
    try:
        _apply(read, plan, base, recorded, published, deadline, out)
    except Exception as exc:  # what a malformed section made raise: the rest reads whole
        log.warning("fetch_slices %s@%d: layout delta failed", read.model, read.version,
                    exc_info=True)  # fmt: skip
        for stats in out.stats.values():
            stats.fallback = f"the delta failed ({type(exc).__name__}: {exc}): read whole"
    return out


def _apply(
    read: BlockRead,
    plan: Mapping[int, Sequence[Part]],
    base: LayoutBase,
    recorded: Sequence[int],
    published: Sequence[int],
    deadline: Deadline,
    out: BlockDelta,
) -> None:
    """`apply_deltas`' steps (module docstring); a chunk is marked present only in the last,
    so whatever raises before leaves every chunk to the reads that follow."""
    parts, shard_of, blocks, dest = read.parts, read.shard_of, read.blocks, read.dest
    names = [spec.name for spec in blocks.layout.tensors]
    touched = [
        {names[s.tensor] for s in blocks.layout.segments(j)}
        for j in range(blocks.layout.num_chunks)
    ]
    # 1. the plan: a block is taken from the delta when every trainer chunk it needs is encoded
    chunks = _trainer_chunks(parts, plan)
    usable = set(read.slices)
    for index, copies in plan.items():
        stats = out.stats[shard_of(index)]
        why = _refusal(parts[index], base.version)
        if why:
            stats.fallback = why
            usable.difference_update(c.name for c in copies)
            continue
        sizes = list(parts[index].delta.encoded_bytes)
        whole = {k for c in copies for k in chunks[index][c.name] if not sizes[k]}
        stats.whole_chunks += len(whole)  # sent whole: their blocks are read whole
        usable.difference_update(c.name for c in copies if chunks[index][c.name] & whole)
    why = _not_worth(parts, plan, chunks, usable, blocks)
    if why:
        for index in plan:
            out.stats[shard_of(index)].fallback = why
        usable.clear()
    # 2. the base: every chunk whose blocks the delta can give must hold exactly u
    checked: list[int] = []
    for j, names_j in enumerate(touched):
        if not names_j or not names_j <= usable:
            continue
        if codec.chunk_checksum(dest, j, XXH3) == base.sums[j]:
            checked.append(j)
            continue
        for index, copies in plan.items():  # counted for each shard whose parts it holds
            if names_j & {c.name for c in copies}:
                out.stats[shard_of(index)].count_mismatch()
    apply = set().union(*(touched[j] for j in checked)) if checked else set()
    # 3. and 4. the encoded chunks those blocks need, read and applied shard by shard
    companions = deadline.part(COMPANION_SHARE, "the encoded chunks of its blocks")
    failed: set[str] = set()
    for index, copies in sorted(plan.items()):
        mine = {c.name: c for c in copies if c.name in apply}
        need = sorted(set().union(*(chunks[index][n] for n in mine)) if mine else set())
        if not need:
            continue
        stats = out.stats[shard_of(index)]
        stats.links = 1
        start = time.monotonic()
        done = _read_and_apply(read, index, need, mine, companions, stats, out.moved)
        stats.seconds += time.monotonic() - start  # its companion's read and apply
        stats.chunks += len(done)
        stats.whole_chunks += len(need) - len(done)
        for name in mine:
            if not chunks[index][name] <= done:
                failed.add(name)
    # 5. the chunks whose blocks got every change: served from now on
    full = len(recorded) == blocks.layout.num_chunks
    ours = len(published) == blocks.layout.num_chunks  # the publisher's wsum64 of each
    for j in checked:
        if not touched[j] <= apply - failed:
            continue
        known = codec.chunk_checksum(dest, j, XXH3)
        if (full and known != recorded[j]) or (
            ours and codec.chunk_checksum(dest, j, WSUM64) != published[j]
        ):
            log.warning("%s@%d blocks %s: chunk %d differs from the record or the publisher's "
                        "checksum after its delta; reading it whole",
                        read.model, read.version, blocks.id, j)  # fmt: skip
            continue
        dest.mark_present(j, known)
    for stats in out.stats.values():
        if stats.whole_chunks and not stats.fallback:
            stats.fallback = f"{stats.whole_chunks} trainer chunks not applied: read whole"


def _not_worth(
    parts: Sequence[pb.Manifest],
    plan: Mapping[int, Sequence[Part]],
    chunks: Mapping[int, Mapping[str, set[int]]],
    usable: set[str],
    blocks: BlockSet,
) -> str | None:
    """Why the delta would cost more than it saves (None: it saves): the encoded chunks
    the `usable` blocks need come to more than `WORTH` of those blocks' own bytes. A
    trainer chunk holds other workers' parts too and its encoding is read whole, so a
    delta of a step that changes most words (the dense form, up to 0.8 of each chunk) can
    move more than the blocks, besides its decode and the base's check."""
    need: dict[int, set[int]] = {}
    for index, copies in plan.items():
        for c in copies:
            if c.name in usable:
                need.setdefault(index, set()).update(chunks[index][c.name])
    encoded = sum(int(parts[i].delta.encoded_bytes[k]) for i, ks in need.items() for k in ks)
    made = sum(spec.nbytes for spec in blocks.layout.tensors if spec.name in usable)
    if made and encoded > WORTH * made:
        return (f"its encoded chunks ({encoded} B) are over {WORTH:.0%} of the blocks they "
                f"make ({made} B): read whole")  # fmt: skip
    return None


def _refusal(manifest: pb.Manifest, base: int) -> str | None:
    """Why a source shard's delta cannot make its blocks from `base` (None: it can)."""
    if not manifest.HasField("delta"):
        return "published without a delta: read whole"
    if manifest.delta.base != base:
        return f"its delta is against {manifest.delta.base}, the blocks hold {base}: read whole"
    if manifest.delta.encoding not in ENCODINGS:
        return f"unknown encoding {manifest.delta.encoding!r}: read whole"
    return None


def _trainer_chunks(
    parts: Sequence[pb.Manifest], plan: Mapping[int, Sequence[Part]]
) -> dict[int, dict[str, set[int]]]:
    """Per source shard and block: the shard's chunks that hold the block's part."""
    out: dict[int, dict[str, set[int]]] = {}
    for index, copies in plan.items():
        layout = layout_of(parts[index])
        specs = {spec.name: spec for spec in layout.tensors}
        out[index] = {c.name: _chunks_of(c, layout, specs[c.name]) for c in copies}
    return out


def _chunks_of(c: Part, layout: Layout, spec: TensorSpec) -> set[int]:
    first, end = byte_span(c.source, c.part, torch_dtype(spec.dtype).itemsize)
    return set(chunks_for(layout, spec, first, end))


def _groups(need: Sequence[int], sizes: Sequence[int]) -> list[list[int]]:
    """`need` (trainer chunks, in order) in groups of at most `STAGING_BUDGET` encoded bytes
    (a chunk over it alone)."""
    groups: list[list[int]] = [[]]
    size = 0
    for k in need:
        if groups[-1] and size + sizes[k] > STAGING_BUDGET:
            groups.append([])
            size = 0
        groups[-1].append(k)
        size += sizes[k]
    return groups


def _read_and_apply(
    read: BlockRead,
    index: int,
    need: list[int],
    copies: Mapping[str, Part],
    deadline: Deadline,
    stats: DeltaStats,
    moved: FetchStats,
) -> set[int]:
    """Read the encoded chunks `need` of source shard `index` from its companion and apply the
    changes inside `copies`' blocks; the trainer chunks applied. A companion that cannot
    be read stops here (the reason in `stats.fallback`): what was applied stays."""
    manifest, shard = read.parts[index], read.shard_of(index)
    runs, version = read.runs, read.version
    section = manifest.delta
    companion = section.companion
    what = f"{companion}@{version}" + ("" if shard is None else f" shard {shard}")
    sizes = [int(n) for n in section.encoded_bytes]
    starts = list(itertools.accumulate(sizes, initial=0))
    layout = layout_of(manifest)
    done: set[int] = set()
    try:
        resolved = runs.resolve(companion, version, shard, deadline)
        found = manifest_of_shard(companion, version, resolved, shard)
        check_companion(found, companion_bytes(section), what)
        staged = layout_of(found)
        spec = staged.tensors[0]
        for group in _groups(need, sizes):
            want: set[int] = set()
            for k in group:
                want.update(chunks_for(staged, spec, starts[k], starts[k + 1]))
            tensors = staged.allocate()  # only the chunks read are ever written (resident)
            held = HeldVersion.reader(read.tenant, companion, version, staged, tensors)
            target = Target(companion, version, shard, held, found, chunks=want, holder=False)
            got = runs.run(target, resolved, deadline, rate_floor=read.rate_floor)
            add_moved(moved, got)
            stats.count(got.total_bytes, got.bytes_per_source)
            data = tensors[TENSOR].numpy().data
            for k in group:
                if apply_chunk(data[starts[k] : starts[k + 1]], section, layout, k, copies,
                               read.slices, read.blocks):  # fmt: skip
                    done.add(k)
            del tensors, held, data
            give_back_freed()
    except TensorHubError as exc:
        stats.fallback = f"{what} could not be read ({type(exc).__name__}: {exc}): read whole"
        log.info("fetch_slices %s@%d: %s", read.model, version, stats.fallback)
    return done
