"""The reader's half of delta versions: turn memory that holds version b into version v by
reading the encoded chunks of b→v instead of whole ones.

`Hub.fetch(model, v, into=T)` (`ros.client.fetching`) calls `DeltaReader.apply` before the
fetch's rounds when v's manifest has a delta section and T holds an earlier version b:
stated by the caller (`base=b`) or known to the SDK (`BaseMemory`: T is the memory of this
client's own earlier fetch of the model). Everything it does is a step of that one fetch,
under the fetch's one `Deadline`. Then, chunk by chunk:

1. **Plan.** Follow the delta sections back from v to b (a chain when b is several
   versions behind, at most `MAX_CHAIN` links; the earlier links' manifests are resolved
   through the fetch's `Orchestrator`). Use them only if the encoded bytes plus the chunks
   they cannot give are fewer bytes than the whole version; else read v whole.
2. **Sample the base.** The first chunk to apply is checked against the base checksum
   v's manifest records before any companion is read: a destination that is not b at all
   reads whole at once (every chunk of it checked, `DeltaStats.base_mismatch`).
3. **Read the encoded chunks**: each link's companion version (`{model}.delta`@u) is one
   more `Target` of the fetch's `Orchestrator`, run in the fetch's own thread within the
   first half of the work time left (`Deadline.part`: the rest reads whole what the delta
   could not give). As a holder (`Hub.fetch`) this client becomes one of its holders, so
   the sources of a delta multiply as readers apply it; the companions are kept and
   served within `hold_bytes` (host memory, over all models), and released with the
   version. A companion whose manifest is not exactly the size that u's manifest gives its
   encoded chunks is not read at all (`DeltaRefused`, before a byte of it moves). One this
   client holds already (the same model, version and shard) is used as it is.
4. **Apply and verify** (`ros.client.delta_chunks.apply_one`; `apply_many` for chunks
   applied together, their changed words decoded at once): each encoded chunk's digest
   is checked, it is XORed into T in place on T's device (`transport.delta`, which refuses
   a zstd frame that declares another size than its chunk's before decoding it), and the
   result must have v's checksum (under a linear checksum, wsum64, also the xxh3-64 v's
   delta section records for it); only then is the chunk marked present, so this client
   serves it. That check of the result is the one read of the chunk's bytes: memory that
   was not b cannot end on v's. A chunk that fails it, or raises anything, is undone (the
   XOR applied again), checked against b to count a destination that was not b, and read
   whole by the rounds that follow, which read exactly the chunks still missing. With one
   link, each encoded chunk is queued as soon as the companion's chunks it lies in have
   landed (the orchestrator's `landed` callback), while the rest are still on the wire;
   the chunks are applied on threads of the delta's own (`ros.client.delta_apply`), so
   the companion's read and its COMPLETE go on meanwhile.

Anything that stops the delta (no companion holder left, a companion retired or of the
wrong size, the deadline of its part, anything a delta made raise) leaves the chunks not
applied to the rounds: slower, never wrong.

This module plans (the chain, which chunks) and reads the companions; one chunk's apply and
checks are `ros.client.delta_chunks`, the threads that apply them `ros.client.delta_apply`,
what memory holds which base `ros.client.delta_bases`, and what a delta did
`ros.client.delta_stats`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

import torch

from ros.client.deadline import Deadline
from ros.client.delta_apply import Applier
from ros.client.delta_bases import BaseMemory, StagedBases
from ros.client.delta_chunks import BaseCheck, Link, check_companion, companion_bytes
from ros.client.delta_stats import DeltaStats
from ros.client.handles import Handles, Held
from ros.client.holdings import Holdings
from ros.client.layout_delta import LayoutBases
from ros.client.manifest import layout_of
from ros.client.orchestrator import Orchestrator, Target, manifest_of_shard
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from tensorhub.checksum_kinds import KINDS, LINEAR
from tensorhub.delta_rules import ENCODINGS
from tensorhub.errors import DeltaRefused, TensorHubError
from transport.layout import Layout
from transport.store import HeldVersion

__all__ = ["DEFAULT_HOLD_BYTES", "MAX_CHAIN", "Applied", "DeltaReader", "DeltaStats"]

log = logging.getLogger(__name__)

MAX_CHAIN = 8  # links a reader follows back to its base; further behind, it reads whole
DEFAULT_HOLD_BYTES = 1 << 30  # host memory a client keeps encoded chunks in to serve them
COMPANION_SHARE = 0.5  # of the work time left: the most the companions' reads may take


@dataclass(frozen=True)
class _Read:
    """A companion read whole: its tensors (the encoded chunks), the bytes that crossed,
    who sent them, and its `Held` when this client holds and serves it (None: read unheld,
    or held here already by another handle)."""

    tensors: Mapping[str, torch.Tensor]
    nbytes: int = 0
    sources: Mapping[str, int] = field(default_factory=dict)
    held: Held | None = None

    def release(self) -> None:
        if self.held is not None:
            self.held.release(force=True)


@dataclass
class Applied:
    """A delta applied: its stats, and the companion kept (served) with the version."""

    stats: DeltaStats
    keep: Held | None


class DeltaReader:
    """Applies deltas for one client (module docstring), through the client's fetch steps
    (`runs`), what it serves (`holdings`) and its handle maker (`handles`, for the
    companions it holds). Thread-safe."""

    def __init__(
        self,
        runs: Orchestrator,
        holdings: Holdings,
        handles: Handles,
        hold_bytes: int = DEFAULT_HOLD_BYTES,
    ) -> None:
        self._runs = runs
        self._holdings = holdings
        self._handles = handles
        self.hold_bytes = hold_bytes
        self.bases = BaseMemory()
        self.staged = StagedBases()  # fetch_slices(delta=True): each source shard's base
        self.layout_bases = LayoutBases()  # fetch_slices(layout=, delta=True): blocks' bases
        self._kept: list[Held] = []  # companions served now (pruned as they are released)
        self._lock = threading.Lock()

    def held_bytes(self) -> int:
        """Bytes of encoded chunks this client keeps and serves now."""
        with self._lock:
            self._kept = [h for h in self._kept if not h.released]
            return sum(_nbytes(h) for h in self._kept)

    def apply(
        self,
        model: str,
        shard: int | None,
        manifest: pb.Manifest,
        dest: HeldVersion,
        base: int,
        deadline: Deadline,
        chunks: Collection[int] | None = None,
        hold: bool = True,
        companion: pb.ResolveResponse | None = None,
    ) -> Applied:
        """Make what chunks it can of `dest` (memory holding `base`) into `manifest`'s
        version from deltas, marking each present (module docstring); the rest is left
        missing for the fetch's rounds. `chunks`: only these are wanted (`fetch_slices`),
        None: all; `hold`: read the companions as their holder (else unheld, kept nowhere);
        `companion`: the Resolve of this version's companion, if the hub answered it with
        the version's. Never raises for a delta that cannot be used: the reason is in the stats."""
        start = time.monotonic()
        stats = DeltaStats(base=base)
        version = dest.key[2]
        try:
            wanted = set(range(len(manifest.chunk_xxh3)) if chunks is None else chunks)
            links, usable = self._chain(
                model, shard, version, dest.layout, manifest, base, deadline, wanted
            )
            kept = self._apply_links(shard, links, usable, dest, stats, deadline, wanted, hold,
                                     companion)  # fmt: skip
        except _NoDelta as why:
            stats.fallback = str(why)
            stats.whole_chunks = len(_missing(dest, chunks))
            kept = None
        except Exception as exc:  # what a hostile delta made raise: the rounds read it whole
            log.warning("fetch %s@%d: delta from %d failed", model, version, base, exc_info=True)
            stats.fallback = f"the delta failed ({type(exc).__name__}: {exc}): read whole"
            stats.whole_chunks = len(_missing(dest, chunks))
            kept = None
        stats.seconds = time.monotonic() - start
        if stats.fallback:
            log.info("fetch %s@%d: delta from %d: %s", model, version, base, stats.fallback)
        return Applied(stats, kept)

    def _manifest(
        self, model: str, version: int, shard: int | None, deadline: Deadline
    ) -> pb.Manifest:
        """The manifest of model@version (of shard `shard`): a chain's earlier link."""
        resolved = self._runs.resolve(model, version, shard, deadline)
        return manifest_of_shard(model, version, resolved, shard)

    def _chain(
        self,
        model: str,
        shard: int | None,
        version: int,
        layout: Layout,
        manifest: pb.Manifest,
        base: int,
        deadline: Deadline,
        wanted: set[int],
    ) -> tuple[list[Link], list[int]]:
        """The links from `base` to `version`, oldest first, and the wanted chunks every link
        encodes (in order); `_NoDelta` if there is none or it would move as many bytes as
        the whole version."""
        if base >= version:
            raise _NoDelta(f"the destination holds {base}, not an earlier version")
        links = [Link(version, manifest)]
        while links[-1].manifest.delta.base != base:
            head = links[-1]
            if not head.manifest.HasField("delta"):
                raise _NoDelta(f"{head.version} was published without a delta")
            if head.manifest.delta.base < base or len(links) >= MAX_CHAIN:
                raise _NoDelta(f"no chain of at most {MAX_CHAIN} deltas leads from {base}")
            earlier = head.manifest.delta.base
            try:
                links.append(Link(earlier, self._manifest(model, earlier, shard, deadline)))
            except TensorHubError as exc:
                raise _NoDelta(f"{earlier}, a link of the chain, is gone ({exc})") from exc
        links.reverse()
        for link in links:
            section = link.manifest.delta
            if section.encoding not in ENCODINGS:
                raise _NoDelta(f"{link.version}: unknown encoding {section.encoding!r}")
            if (link.manifest.chunk_size, link.manifest.checksum) != (
                manifest.chunk_size,
                manifest.checksum,
            ) or len(link.manifest.chunk_xxh3) != len(manifest.chunk_xxh3):
                raise _NoDelta(f"{link.version} is laid out otherwise")
        if manifest.checksum not in ("", *KINDS):
            raise _NoDelta(f"unknown checksum {manifest.checksum!r}")
        if manifest.checksum in LINEAR and len(manifest.delta.result_xxh3) != len(
            manifest.chunk_xxh3
        ):
            raise _NoDelta(
                f"{version} is checksummed with {manifest.checksum}, which is linear, and its "
                "delta records no xxh3-64 of each chunk it makes"
            )
        # each link's sizes as a list, once: it indexes faster than a repeated field
        sizes = [list(link.manifest.delta.encoded_bytes) for link in links]
        usable = _usable(sizes, wanted)
        encoded = sum(n[i] for n in sizes for i in usable)
        whole = sum(layout.payload_bytes(i) for i in wanted.difference(usable))
        if encoded + whole >= sum(layout.payload_bytes(i) for i in wanted):
            raise _NoDelta(
                f"{len(links)} deltas ({encoded} bytes, and {whole} whole) move no fewer bytes "
                "than the whole version"
            )
        return links, usable

    def _apply_links(
        self,
        shard: int | None,
        links: list[Link],
        usable: list[int],
        dest: HeldVersion,
        stats: DeltaStats,
        deadline: Deadline,
        wanted: set[int],
        hold: bool,
        resolved: pb.ResolveResponse | None,
    ) -> Held | None:
        """Read each link's companion, oldest first, within the first half of the work time
        left, and apply the chain to the usable chunks (as they land, for one link); the
        companion of the last link kept (served) when it fits in `hold_bytes`."""
        kind = links[-1].manifest.checksum or KINDS[0]
        is_base = BaseCheck(dest, links[0].manifest.delta.base_checksum, kind, stats.count_mismatch)
        # one chunk sampled: memory that is not the base at all is found before anything
        # is read (each chunk applied is checked by its result, which the base must give)
        todo = usable if is_base(usable[0]) else [i for i in usable if is_base(i)]
        if not todo:
            raise _NoDelta(f"no chunk of the destination is exactly {links[0].manifest.delta.base}")
        part = deadline.part(COMPANION_SHARE, "the encoded chunks of its delta")
        reads: list[_Read] = []
        with Applier(links, dest, todo, kind, is_base) as applier:
            try:
                for link in links:
                    pre = resolved if link is links[-1] else None  # only v's came with v's
                    streams = len(links) == 1  # a chain is applied once every link is in
                    try:
                        read = self._read(
                            link, shard, part, hold, pre, applier if streams else None
                        )
                    except TensorHubError as exc:
                        companion = f"{link.manifest.delta.companion}@{link.version}"
                        why = f"{companion} could not be read ({exc})"
                        applier.wait(deadline.work_end)  # the chunks that landed before it
                        if not applier.done:
                            raise _NoDelta(why) from exc
                        stats.fallback = why  # what was applied before it failed stays
                        break
                    reads.append(read)
                    stats.count(read.nbytes, read.sources)
                else:
                    applier.finish([read.tensors for read in reads], deadline.work_end)
            except BaseException:
                applier.close()  # nothing writes `dest` once the fetch goes on without it
                for read in reads:
                    read.release()
                raise
        stats.links = len(links)
        stats.chunks = applier.done
        stats.whole_chunks = len(_missing(dest, wanted))
        if applier.failed and not stats.fallback:
            stats.fallback = f"{applier.failed} chunks failed a check after applying: read whole"
        if len(reads) < len(links):  # a read failed: nothing of the chain is kept
            for read in reads:
                read.release()
            return None
        for read in reads[:-1]:  # earlier links: the readers behind this one need v's
            read.release()
        last = reads[-1].held
        return None if last is None else self._keep(last)

    def _read(
        self,
        link: Link,
        shard: int | None,
        deadline: Deadline,
        hold: bool,
        resolved: pb.ResolveResponse | None,
        applier: Applier | None,
    ) -> _Read:
        """Read `link`'s companion (of shard `shard`) whole, as one more target of the
        fetch: as its holder, or unheld (`fetch_slices`, whose reader holds nothing);
        `resolved` is its Resolve when the hub answered it with its version's; `applier`,
        if given, is told of each of its chunks as it lands. One this client holds already
        (the same model, version and shard) is used as it is: nothing crosses, and it stays
        with the handle that holds it. `DeltaRefused`, before any of it is read, when its
        manifest is not the size its version's manifest gives its encoded chunks."""
        model, version = link.manifest.delta.companion, link.version
        nbytes = companion_bytes(link.manifest.delta)
        what = f"{model}@{version}" + ("" if shard is None else f" shard {shard}")
        mine = self._held_here(model, version, shard)
        if mine is not None:
            if sum(t.numel() * t.element_size() for t in mine.tensors.values()) != nbytes:
                raise DeltaRefused(f"{what} held here is not the {nbytes} bytes its version's is")
            return _Read(mine.tensors)
        if resolved is None or int(resolved.version) != version:
            resolved = self._runs.resolve(model, version, shard, deadline)
        manifest = manifest_of_shard(model, version, resolved, shard)
        check_companion(manifest, nbytes, what)
        layout = layout_of(manifest)
        tensors = layout.allocate()
        read = HeldVersion.reader(self._holdings.tenant, model, version, layout, tensors)
        target = Target(model, version, shard, read, manifest, holder=hold)
        told = None if applier is None else applier.watch(read)
        stats = self._runs.run(target, resolved, deadline, landed=told)
        held = self._handles.held(model, version, tensors, stats, shard) if hold else None
        return _Read(tensors, stats.total_bytes, dict(stats.bytes_per_source), held)

    def _held_here(self, model: str, version: int, shard: int | None) -> HeldVersion | None:
        """This client's complete copy of `model@version` of shard `shard`, if it holds one
        (a copy of another shard is another companion: its encoded chunks are not these)."""
        mine = self._holdings.get((self._holdings.tenant, model, version))
        if mine is None or not mine.complete or mine.released:
            return None
        return mine if self._holdings.shard(model, version) == shard else None

    def _keep(self, held: Held) -> Held | None:
        """Keep serving `held` if it fits in `hold_bytes` with what is kept already; else
        release it now (it was read, and applied)."""
        with self._lock:
            self._kept = [h for h in self._kept if not h.released]
            if sum(_nbytes(h) for h in self._kept) + _nbytes(held) <= self.hold_bytes:
                self._kept.append(held)
                return held
        held.release(force=True)
        return None


class _NoDelta(Exception):
    """Why a delta cannot be used: the version is read whole (never raised out of here)."""


def _usable(sizes: list[list[int]], wanted: set[int]) -> list[int]:
    """The wanted chunks (in order) every link encodes, given each link's encoded sizes (a
    chunk one link sends whole, size 0, is read whole)."""
    if len(sizes) == 1:
        only = sizes[0]
        return [i for i in sorted(wanted) if only[i]]
    return [i for i in sorted(wanted) if all(n[i] for n in sizes)]


def _missing(dest: HeldVersion, wanted: Collection[int] | None) -> list[int]:
    return [i for i in dest.missing() if wanted is None or i in wanted]


def _nbytes(held: Held) -> int:
    return sum(t.numel() * t.element_size() for t in held.tensors.values())
