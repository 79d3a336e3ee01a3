"""Readers in another layout become holders of their blocks (docs/design-notes.md, "Readers
in another layout"; `Hub.fetch_slices(layout=...)`).

A worker's blocks (one box of each global tensor it takes) form a `BlockSet`: a layout of
their own (each block one tensor, sorted by name, in the publisher's chunk size) and an id,
a digest of the boxes, dtypes and chunk size, so that every worker taking the same blocks
names them alike. A reader in a layout, pipelined as a reader of a whole version is:

1. serves its blocks' memory at once, as a PARTIAL holder of its block set
   (`start_holding`, `RegisterLayoutHolder`, whose transaction also pins the version until
   the COMPLETE registration or the release): a chunk is served from the moment every byte
   of it is verified, with the xxh3-64 computed then;
2. learns, from that registration's answer (what a `ResolveLayout` at its revision would
   answer; each later round asks `ResolveLayout`), the holders of its block set (at most a
   few, nearest first) and the checksums recorded for it, and reads its blocks from ONE of those
   registered before it (`transport.planner.pipeline_sources`: chains, as for whole
   versions; the first registrant has none and reads from the trainer), each chunk checked
   against the publisher's wsum64 of it when the layout was declared before the version's
   publish (`ros.client.publisher_sums`), else against the recorded checksums, or, before
   any exist, against the checksum its holder computed when it verified that chunk
   (`checked_against`); a holder that fails or sends bad bytes is dropped, for a bounded
   number of rounds (`read_from_peers`);
3. reads what is still missing (every block a missing chunk touches: no holder, a holder
   killed mid-read, bad bytes) from the trainer's shards, checked against the publisher's
   chunk checksums (`ros.client.slices`), marking each chunk present as soon as its own
   bytes are in place, each written from a verified trainer chunk (`ros.client.slice_fill`;
   `settle` marks those no trainer byte goes into);
4. registers as the COMPLETE holder (`finish_holding`) with the checksums of its chunks;
   the first reader's become the record, and a reader whose bytes differ from the record
   serves nothing from then on (logged).

So every byte a reader ends with was checked against the publisher: directly (the trainer's
shards, or a declared layout's publisher checksums), or through checksums derived only from
bytes checked so, by a reader (the record) or by the holder it read from (a chunk's
checksum in its CHUNK frame, docs/security.md).
`release_blocks` (or `close()`, or the session's lease) ends the holding; the version's
retention deletes its block sets' keys with it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from itertools import pairwise

import torch

from ros.client.deadline import MIN_CALL, Deadline
from ros.client.holdings import Holdings
from ros.client.hooks import RoundReader
from ros.client.identity import Identity
from ros.client.read_token import RenewingToken
from ros.client.records import HolderRecords
from ros.client.rpc import Rpc
from ros.client.serving import Serving
from ros.client.slice import Slice
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from tensorhub.checksum_kinds import WSUM64, XXH3
from tensorhub.errors import AlreadyExists, InvalidArgument, QuotaExceeded, TensorHubError
from transport.backend import TransportKind
from transport.boxes import Box
from transport.layout import Layout, dtype_name
from transport.outcome import FetchStats
from transport.pace import DEFAULT_RATE_FLOOR
from transport.planner import Candidate, Source, pipeline_sources
from transport.selection import choose
from transport.store import HeldVersion
from transport.topology import Topology
from transport.transports import ReaderBackends

log = logging.getLogger(__name__)

PEER_ROUNDS = 3
"""Rounds of reading from a block set's holders (each with a fresh ResolveLayout, less the
holders that failed) before what is missing is read from the trainer's shards."""

PIPELINE_STEPS = 8
"""A first reader reads its blocks from the trainer's shards in about this many steps of
whole blocks (at most `ros.client.slice_staging.STAGING_BUDGET` bytes each), the source
shards at once, each chunk of its block set served as soon as its own bytes are in place:
the steps keep the chunks completing in the block set's order (a reader chained behind it
asks for them in that order) and bound a step's staging copies."""


@dataclass(frozen=True)
class BlockSet:
    """One worker's blocks: their own layout (one tensor per block, sorted by name), the
    tensors they are read into and served from, and their id."""

    id: str
    layout: Layout
    tensors: dict[str, torch.Tensor]
    description: bytes  # what `id` is the digest of (`describe`)


def block_set(slices: Mapping[str, Slice], chunk_size: int) -> BlockSet:
    """The block set of `slices` in chunks of `chunk_size` (the publisher's). Each slice's
    tensor must be contiguous (it is served as it is, never copied) and the tensors must
    not share memory (`InvalidArgument`)."""
    tensors: dict[str, torch.Tensor] = {}
    boxes: dict[str, tuple[str, tuple[int, ...], Box]] = {}
    for name in sorted(slices):
        want = slices[name]
        tensor = want.tensor.detach()
        if not tensor.is_contiguous():
            raise InvalidArgument(
                f"{name!r}: a reader in a layout serves its blocks from their memory, which "
                "must be contiguous (pass a contiguous tensor)"
            )
        tensors[name] = tensor
        glob = tuple(int(d) for d in want.global_shape)
        boxes[name] = (dtype_name(tensor.dtype), glob, want.box)
    spans = sorted(
        (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
        for t in tensors.values()
        if t.numel()
    )
    if any(start < end for (_, end), (start, _) in pairwise(spans)):
        raise InvalidArgument("the slices of a reader in a layout must not share memory")
    description = describe(boxes, chunk_size)
    digest = digest_of(description)
    layout = Layout.from_tensors(tensors, chunk_size=chunk_size)
    return BlockSet(digest, layout, tensors, description)


@dataclass
class _Holding:
    layout: str
    block_set: str
    key: tuple[str, str, int]
    sums: list[int] = field(default_factory=list)
    description: bytes = b""
    complete: bool = False  # PARTIAL while its reader reads (`start_holding`)


@dataclass
class LayoutHoldings:
    """The block sets this client holds: by (model, version), the layout and block set its
    record is under. Thread-safe."""

    _held: dict[tuple[str, int], _Holding] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def put(self, model: str, version: int, holding: _Holding) -> None:
        with self._lock:
            self._held[(model, version)] = holding

    def get(self, model: str, version: int) -> _Holding | None:
        with self._lock:
            return self._held.get((model, version))

    def take(self, model: str, version: int) -> _Holding | None:
        with self._lock:
            return self._held.pop((model, version), None)


@dataclass(frozen=True)
class LayoutPeers:
    """What a reader in a layout needs of its client: hub calls, what it holds and serves,
    its holder records, its round reader and reader backends."""

    rpc: Rpc
    holdings: Holdings
    serving: Serving
    records: HolderRecords
    held: LayoutHoldings
    read: RoundReader
    readers: ReaderBackends


@dataclass
class PeerRead:
    """What reading from a block set's holders did: the bytes per holder, the holders
    given up on (and why), the checksums recorded for the block set (empty: none yet) and
    the blocks not read whole from them."""

    stats: FetchStats = field(default_factory=FetchStats)
    sums: list[int] = field(default_factory=list)
    missing_blocks: set[str] = field(default_factory=set)
    published: bool = False  # peers' chunks were checked against the publisher's sums


@dataclass(frozen=True)
class LayoutRead:
    """One reader's holding of its block set, as each step of it takes it (`start_holding`,
    `read_from_peers`, `finish_holding`): the client's `peers` and identity (`me`), the
    version read (`model`@`version`), the layout's name and the reader's `blocks` in it,
    and the read's `deadline`."""

    peers: LayoutPeers
    me: Identity
    model: str
    version: int
    layout: str
    blocks: BlockSet
    deadline: Deadline


def describe(blocks: Mapping[str, tuple[str, tuple[int, ...], Box]], chunk_size: int) -> bytes:
    """A block set's description: the chunk size and, per block sorted by name, its name,
    dtype, global shape, offsets and shape (canonical JSON: its SHA-256 is the id)."""
    rows = [
        [name, dtype, list(glob), list(box.offsets), list(box.shape)]
        for name, (dtype, glob, box) in sorted(blocks.items())
    ]
    return json.dumps({"chunk_size": chunk_size, "blocks": rows}, separators=(",", ":")).encode()


def digest_of(description: bytes) -> str:
    """A block set's id: the first 128 bits of SHA-256 over its description, in hex."""
    return hashlib.sha256(description).hexdigest()[:32]


def check_free(
    peers: LayoutPeers, me: Identity, model: str, blocks: BlockSet, version: int
) -> None:
    """Refuse before any byte moves: a client holds one copy of a version, and memory that
    serves another version (blocks of an earlier one: `release_blocks` first) is not
    overwritten under its readers (`InvalidArgument`)."""
    peers.holdings.check_free(blocks.tensors)
    if peers.holdings.get((me.tenant, model, version)) is not None:
        raise AlreadyExists(
            f"this client already holds {model}@{version} (the whole version, a shard or "
            "a layout's blocks): release it first; workers in a layout use one client each"
        )


def _resolve(read: LayoutRead) -> pb.ResolveLayoutResponse:
    me = read.me
    request = pb.ResolveLayoutRequest(
        model=read.model, version=read.version, layout=read.layout, block_set=read.blocks.id,
        topology=me.topology.labels(), holder=me.holder_name,
    )  # fmt: skip
    return read.peers.rpc("ResolveLayout", request, read.deadline.work(me.timeout))


def sources_of(holders: list[pb.Holder], suspects: Mapping[str, object]) -> list[Source]:
    """The holders not given up on, each over TCP (what every holder server answers)."""
    out = []
    for h in holders:
        if h.name in suspects:
            continue
        try:
            route = choose(h.endpoints, complete=True, local=[TransportKind.TCP])
        except InvalidArgument as exc:
            log.warning("skipping layout holder %s: %s", h.name, exc)
            continue
        topology = Topology.of(h.topology)
        out.append(Source(h.name, route.host, route.port, topology, transport=route.kind))
    return out


def predecessors(
    me: Identity, fence: int, holders: list[pb.Holder], suspects: Mapping[str, object]
) -> list[Source]:
    """The holders to read from, of those not given up on: every COMPLETE one (the chunks
    spread over them), else ONE of the PARTIAL ones registered before us (`fence`), chosen
    as for whole versions (`transport.planner.pipeline_sources`: chains), never one after
    us (no cycle). [] when there is none: the first registrant reads from the trainer's
    shards."""
    usable = [h for h in holders if h.name != me.holder_name]
    by_name = {s.holder_id: s for s in sources_of(usable, suspects)}
    complete = [by_name[h.name] for h in usable if h.name in by_name and h.state == pb.COMPLETE]
    if complete:
        return complete
    candidates = [
        Candidate(by_name[h.name], int(h.fence), False) for h in usable if h.name in by_name
    ]
    return pipeline_sources(me.topology, fence, candidates)


@dataclass(frozen=True)
class Holding:
    """What `start_holding` started: the memory served, our record's fence, and the hub's
    answer to the registration as a `ResolveLayout` answer (the holders and checksums at
    the registration's revision), the first round's of `read_from_peers`."""

    dest: HeldVersion
    fence: int
    found: pb.ResolveLayoutResponse


def start_holding(read: LayoutRead) -> Holding:
    """Serve `blocks`' memory as a PARTIAL holder before any byte arrives (each chunk from
    the moment it is verified) and register so (no checksums yet); the registration
    answers the block set's holders too. `release` undoes it."""
    peers, me, model, version = read.peers, read.me, read.model, read.version
    layout, blocks, deadline = read.layout, read.blocks, read.deadline
    dest = HeldVersion.reader(me.tenant, model, version, blocks.layout, blocks.tensors)
    peers.serving.start()
    peers.holdings.hold_layout(dest)
    request = pb.RegisterLayoutHolderRequest(
        model=model, version=version, layout=layout, block_set=blocks.id,
        holder=peers.records.record(False), blocks=blocks.description,
    )  # fmt: skip
    try:
        answer = peers.rpc("RegisterLayoutHolder", request, deadline.work(me.timeout))
    except BaseException:
        peers.holdings.drop(dest.key, 1.0)
        raise
    peers.held.put(model, version, _Holding(layout, blocks.id, dest.key, [], blocks.description))
    found = pb.ResolveLayoutResponse(
        holders=answer.holders, block_sums=answer.block_sums, revision=answer.revision,
        total_holders=answer.total_holders, publisher_sums=answer.publisher_sums,
    )  # fmt: skip
    return Holding(dest, int(answer.fence), found)


def settle(dest: HeldVersion, done: set[str], unverified: Collection[int] = ()) -> int:
    """Mark present every missing chunk of `dest` whose blocks are all in `done` (every byte
    of them verified and in place), with its xxh3-64 computed now, over those bytes (in GPU
    memory: when first served, or at `finish_holding`); from then on it is served. How many.
    Not the chunks in `unverified` (written from byte ranges and not what the publisher's
    checksum says: `slice_fill.Fill.failed`)."""
    names = [spec.name for spec in dest.layout.tensors]
    marked = 0
    for index in dest.missing():
        if index in unverified:
            continue
        if all(names[seg.tensor] in done for seg in dest.segments(index)):
            dest.mark_present(index, None)
            if not dest.on_cuda:
                dest.checksum(index)
            marked += 1
    return marked


def read_from_peers(
    read: LayoutRead, held: Holding, token: RenewingToken, rate_floor: float = DEFAULT_RATE_FLOOR
) -> PeerRead:
    """Read `blocks` into `held.dest` from the holders of their block set (module
    docstring, step 2): the first round from the registration's answer (`held.found`),
    each later one from a fresh `ResolveLayout`; the blocks not read whole from them are
    in `missing_blocks` (all of them when no holder was registered before us)."""
    peers, me, blocks = read.peers, read.me, read.blocks
    out = PeerRead()
    dest, fence = held.dest, held.fence
    suspects: dict[str, BaseException] = {}
    for round_ in range(PEER_ROUNDS):
        answer = held.found if round_ == 0 else _resolve(read)
        out.sums = list(answer.block_sums)
        expected, checksum = checked_against(blocks, out.sums, list(answer.publisher_sums))
        out.published = checksum == WSUM64
        sources = predecessors(me, fence, list(answer.holders), suspects)
        if not sources:
            break
        done = peers.read(
            me.tenant, read.model, read.version, blocks.layout, dest, sources, token=token,
            deadline=read.deadline.work_end, me=me.topology, expected=expected,
            checksum=checksum, tls=me.tls, stats=out.stats, readers=peers.readers,
            rate_floor=rate_floor,
        )  # fmt: skip
        suspects.update(done.failures)
        if done.done:
            break
    for name, exc in suspects.items():
        out.stats.failed_sources.setdefault(name, f"{type(exc).__name__}: {exc}")
    names = [spec.name for spec in blocks.layout.tensors]
    for index in dest.missing():
        out.missing_blocks.update(names[s.tensor] for s in blocks.layout.segments(index))
    return out


def checked_against(
    blocks: BlockSet, recorded: list[int], published: list[int]
) -> tuple[list[int] | None, str]:
    """What a chunk from a peer is checked against, and by which algorithm: the publisher's
    wsum64 of every chunk (a layout declared before the version's publish), else the
    record's xxh3-64 (the first COMPLETE reader's), else nothing beyond the checksum in the
    holder's CHUNK frame (None)."""
    chunks = blocks.layout.num_chunks
    if len(published) == chunks:
        return published, WSUM64
    if len(recorded) == chunks:
        return recorded, XXH3
    return None, XXH3


def finish_holding(read: LayoutRead, dest: HeldVersion, recorded: list[int]) -> bool:
    """Register as the COMPLETE holder of `blocks` (every byte in `dest` checked against the
    publisher by now, directly or through checksums derived from such bytes), with the
    checksums of its chunks; whether it serves. Blocks whose checksums differ from the
    ones recorded are not served from then on (logged): the reader keeps its bytes."""
    peers, me, model, version = read.peers, read.me, read.model, read.version
    layout, blocks, deadline = read.layout, read.blocks, read.deadline
    dest.precompute_checksums()  # in GPU memory: over staged host bytes
    mine = [dest.checksum(i) for i in range(blocks.layout.num_chunks)]
    what = f"{model}@{version} layout {layout!r} blocks {blocks.id}"
    if recorded and recorded != mine:
        log.error("%s: our verified bytes differ from the recorded checksums; not serving", what)
        release(peers, me, model, version, cleanup_time(me, deadline))
        return False
    request = pb.RegisterLayoutHolderRequest(
        model=model, version=version, layout=layout, block_set=blocks.id,
        holder=peers.records.record(True), block_sums=mine, blocks=blocks.description,
    )  # fmt: skip
    try:
        answer = peers.rpc("RegisterLayoutHolder", request, deadline.work(me.timeout))
    except QuotaExceeded as exc:  # the reader keeps its verified bytes; it serves none
        release(peers, me, model, version, cleanup_time(me, deadline))
        log.warning("%s: not served: %s", what, exc)
        return False
    holding = _Holding(layout, blocks.id, dest.key, mine, blocks.description, complete=True)
    peers.held.put(model, version, holding)
    if list(answer.block_sums) != mine:  # another reader recorded different ones meanwhile
        log.error("%s: the recorded checksums differ from our verified bytes; not serving", what)
        release(peers, me, model, version, cleanup_time(me, deadline))
        return False
    return True


def reregister(peers: LayoutPeers, me: Identity, model: str, version: int) -> None:
    """Register our blocks of model@version again, under the current session (a session
    recovery: the record went with the lost lease); `VersionNotFound` once retired."""
    holding = peers.held.get(model, version)
    if holding is None:
        return
    request = pb.RegisterLayoutHolderRequest(
        model=model, version=version, layout=holding.layout, block_set=holding.block_set,
        holder=peers.records.record(holding.complete), block_sums=holding.sums,
        blocks=holding.description,
    )  # fmt: skip
    peers.rpc("RegisterLayoutHolder", request, me.timeout)


def cleanup_time(me: Identity, deadline: Deadline) -> float:
    """Seconds a release at the end of a read may take: what is left of the deadline (at
    most the client's call timeout), else a last short try (the lease removes the rest)."""
    return deadline.finish(me.timeout) or MIN_CALL


def release(peers: LayoutPeers, me: Identity, model: str, version: int, timeout: float) -> bool:
    """Stop holding our blocks of model@version: delete the record first (no reader finds us
    from then on), then stop serving, waiting up to `timeout` for reads in flight. Whether
    there was a holding."""
    holding = peers.held.take(model, version)
    if holding is None:
        return False
    request = pb.ReleaseLayoutHolderRequest(
        model=model, version=version, layout=holding.layout, block_set=holding.block_set,
        holder=me.holder_name, session_id=peers.records.session_id,
    )  # fmt: skip
    try:
        peers.rpc("ReleaseLayoutHolder", request, timeout)
    except TensorHubError as exc:  # the session's lease removes it when we go
        log.warning("release of %s@%d's layout record not done: %s", model, version, exc)
    finally:
        peers.holdings.drop(holding.key, timeout)
    return True
