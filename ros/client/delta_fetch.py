"""The reader's half of delta versions: turn memory that holds version b into version v by
reading the encoded chunks of b→v instead of whole ones.

`Hub.fetch(model, v, into=T)` calls `DeltaReader.apply` before the fetch's rounds when v's
manifest has a delta section and T holds an earlier version b: stated by the caller
(`base=b`) or known to the SDK (`BaseMemory`: T is the memory of this client's own earlier
fetch of the model). Then, chunk by chunk:

1. **Plan.** Follow the delta sections back from v to b (a chain when b is several
   versions behind, at most `MAX_CHAIN` links). Use them only if the encoded bytes plus the
   chunks they cannot give are fewer bytes than the whole version; else read v whole.
2. **Check the base.** A chunk is applied only if T's bytes are exactly b's (its checksum
   equals the base checksum v's manifest records). Any other chunk is read whole: a
   destination that is not b never gets a wrong result (`DeltaStats.base_mismatch`).
3. **Read the encoded chunks** by fetching each link's companion version
   (`{model}.delta`@u) like any version: this client becomes one of its holders, so the
   sources of a delta multiply as readers apply it. The companions are kept and served
   within `hold_bytes` (host memory, over all models), and released with the version. A
   companion whose manifest is not exactly the size that u's manifest gives its encoded
   chunks is not read at all (`DeltaRefused`, before a byte of it moves).
4. **Apply and verify**: each encoded chunk's digest is checked, it is XORed into T in
   place on T's device (`transport.delta`, which refuses a zstd frame that declares another
   size than its chunk's before decoding it), and the result must have the checksum of the
   next link's base, and at the end v's own (under a linear checksum, wsum64, also the
   xxh3-64 v's delta section records for it); only then is the chunk marked present, so
   this client serves it. A chunk that fails any check, or raises anything, is read whole
   by the rounds that follow, which read exactly the chunks still missing.

Anything that stops the delta (no companion holder left, a companion retired or of the
wrong size, the deadline of its part, anything a delta made raise) leaves the chunks not
applied to the rounds: slower, never wrong.

This module plans (the chain, which chunks) and reads the companions; one chunk's apply and
checks are `ros.client.delta_chunks`, and what memory holds which base `ros.client.delta_bases`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field

import torch

from ros.client.deadline import Deadline
from ros.client.delta_bases import BaseMemory, StagedBases
from ros.client.delta_chunks import (
    BaseCheck,
    Encoded,
    Link,
    apply_one,
    companion_bytes,
    landed,
)
from ros.client.handles import Held
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from tensorhub.checksum_kinds import KINDS, LINEAR
from tensorhub.delta_rules import ENCODINGS
from tensorhub.errors import TensorHubError
from transport.layout import Layout
from transport.store import HeldVersion

log = logging.getLogger(__name__)

MAX_CHAIN = 8  # links a reader follows back to its base; further behind, it reads whole
DEFAULT_HOLD_BYTES = 1 << 30  # host memory a client keeps encoded chunks in to serve them


@dataclass(frozen=True)
class Companion:
    """A companion version read whole: its tensors (the encoded chunks), the bytes that
    crossed, its `Held` when this client holds and serves it (None: read unheld), and the
    bytes each holder sent of it."""

    tensors: Mapping[str, torch.Tensor]
    nbytes: int
    held: Held | None = None
    sources: Mapping[str, int] = field(default_factory=dict)

    def release(self) -> None:
        if self.held is not None:
            self.held.release(force=True)


FetchCompanion = Callable[
    [str, int, int | None, float, bool, pb.ResolveResponse | None, int], Companion
]
"""Read (model, version, shard, timeout, hold, resolved, nbytes) whole: as a holder that
serves it (`hold`), or unheld (a `fetch_slices` reader, which holds nothing); `resolved`, when
not None, is its Resolve, answered with its version's (no second call). `nbytes` is the size
its version's manifest gives it: a companion of another size is refused before any of it is
read (`delta_chunks.check_companion`, raising `DeltaRefused`)."""
ResolveManifest = Callable[[str, int, int | None, Deadline], pb.Manifest]
"""The manifest of (model, version, shard): how a chain's earlier links are found."""
FindHeld = Callable[[str, int], HeldVersion | None]
"""This client's holding of (model, version), if any: how a companion's read is followed."""


@dataclass
class DeltaStats:
    """What a fetch's delta did (`Held.delta`); all zero when it read the version whole."""

    base: int = 0  # the version the destination held, that the deltas were applied to
    links: int = 0  # deltas applied one after the other (more than 1: a chain)
    chunks: int = 0  # chunks made from deltas
    encoded_bytes: int = 0  # bytes of the companions read (what crossed the network)
    # of those, by holder id (the fetch's `FetchStats.bytes_per_source` counts them too)
    bytes_per_source: dict[str, int] = field(default_factory=dict)
    whole_chunks: int = 0  # chunks left to be read whole (not encoded, or failed a check)
    base_mismatch: int = 0  # of those: the destination's bytes were not exactly the base's
    seconds: float = 0.0  # the delta's part of the fetch: plan, read, apply, verify
    fallback: str = ""  # why the delta was not used, or was used only in part

    def count_mismatch(self) -> None:
        """One more chunk whose destination bytes were not exactly the base's."""
        self.base_mismatch += 1

    def count(self, read: Companion) -> None:
        """A companion read: its bytes, and who sent them."""
        self.encoded_bytes += read.nbytes
        for source, nbytes in read.sources.items():
            self.bytes_per_source[source] = self.bytes_per_source.get(source, 0) + nbytes


@dataclass
class Applied:
    """A delta applied: its stats, and the companion kept (served) with the version."""

    stats: DeltaStats
    keep: Held | None


class DeltaReader:
    """Applies deltas for one client (module docstring). Thread-safe."""

    def __init__(
        self,
        fetch_companion: FetchCompanion,
        resolve: ResolveManifest,
        hold_bytes: int = DEFAULT_HOLD_BYTES,
        find: FindHeld | None = None,
    ) -> None:
        self._fetch_companion = fetch_companion
        self._find = find  # this client's holding of (model, version), as soon as it starts
        self._resolve = resolve
        self.hold_bytes = hold_bytes
        self.bases = BaseMemory()
        self.staged = StagedBases()  # fetch_slices(delta=True): each source shard's base
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
            links = self._chain(
                model, shard, version, dest.layout, manifest, base, deadline, wanted
            )
            kept = self._apply_links(shard, links, dest, stats, deadline, wanted, hold, companion)
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
    ) -> list[Link]:
        """The links from `base` to `version`, oldest first; `_NoDelta` if there is none or
        it would move as many bytes as the whole version."""
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
                links.append(Link(earlier, self._resolve(model, earlier, shard, deadline)))
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
        usable = self._usable(links, wanted)
        encoded = sum(link.manifest.delta.encoded_bytes[i] for link in links for i in usable)
        whole = sum(layout.payload_bytes(i) for i in wanted - usable)
        if encoded + whole >= sum(layout.payload_bytes(i) for i in wanted):
            raise _NoDelta(
                f"{len(links)} deltas ({encoded} bytes, and {whole} whole) move no fewer bytes "
                "than the whole version"
            )
        return links

    @staticmethod
    def _usable(links: list[Link], wanted: set[int]) -> set[int]:
        """The wanted chunks every link encodes (one sent whole by any link is read whole)."""
        return {i for i in wanted if all(k.manifest.delta.encoded_bytes[i] for k in links)}

    def _apply_links(
        self,
        shard: int | None,
        links: list[Link],
        dest: HeldVersion,
        stats: DeltaStats,
        deadline: Deadline,
        wanted: set[int],
        hold: bool,
        resolved: pb.ResolveResponse | None,
    ) -> Held | None:
        kind = links[-1].manifest.checksum or KINDS[0]
        usable = sorted(self._usable(links, wanted))
        sums = links[0].manifest.delta.base_checksum
        is_base = BaseCheck(dest, sums, kind, stats.count_mismatch)
        if len(links) == 1 and hold and self._find is not None and usable and is_base(usable[0]):
            # the memory is the base where it starts: the rest is checked while the delta
            # is on its way (a memory that is not the base at all reads whole at once)
            return self._apply_streaming(
                links[0], shard, dest, usable, is_base, kind, stats, deadline, wanted, resolved
            )
        todo = [index for index in usable if is_base(index)]
        if not todo:
            raise _NoDelta(f"no chunk of the destination is exactly {links[0].manifest.delta.base}")
        companions: list[Companion] = []
        try:
            for link in links:
                companion = link.manifest.delta.companion
                try:
                    # at most half of what is left: the rest reads whole what the delta
                    # could not give, should its holders be dead or frozen
                    half = deadline.work((deadline.work_end - time.monotonic()) / 2)
                    pre = resolved if link is links[-1] else None  # only v's came with v's
                    size = companion_bytes(link.manifest.delta)
                    read = self._fetch_companion(
                        companion, link.version, shard, half, hold, pre, size
                    )
                except TensorHubError as exc:
                    raise _NoDelta(f"{companion}@{link.version} could not be read ({exc})") from exc
                companions.append(read)
                stats.count(read)
            failed = self._apply_chunks(links, companions, dest, todo, kind)
        except BaseException:
            for read in companions:
                read.release()
            raise
        stats.links = len(links)
        stats.chunks = len(todo) - len(failed)
        stats.whole_chunks = len(_missing(dest, wanted))
        if failed:
            stats.fallback = f"{len(failed)} chunks failed a check after applying: read whole"
        for read in companions[:-1]:  # earlier links: the readers behind this one need v's
            read.release()
        last = companions[-1].held
        return None if last is None else self._keep(last)

    def _apply_chunks(
        self,
        links: list[Link],
        companions: list[Companion],
        dest: HeldVersion,
        todo: list[int],
        kind: str,
    ) -> list[int]:
        """Apply every link to each chunk of `todo`, verifying as it goes; mark each chunk
        that ends as the version's present. The chunks that failed a check (left missing,
        their memory no longer the base: the rounds read them whole)."""
        pairs = zip(links, companions, strict=True)
        blobs = [Encoded(link.manifest.delta, read.tensors) for link, read in pairs]
        return [index for index in todo if not apply_one(links, blobs, dest, index, kind)]

    def _apply_streaming(
        self,
        link: Link,
        shard: int | None,
        dest: HeldVersion,
        usable: list[int],
        is_base: BaseCheck,
        kind: str,
        stats: DeltaStats,
        deadline: Deadline,
        wanted: set[int],
        resolved: pb.ResolveResponse | None,
    ) -> Held | None:
        """One link, read as its holder: check which of the `usable` chunks of `dest` are
        the base while the companion is being found and read, and apply each as soon as its
        encoded bytes have landed in the companion's memory, while the rest are still on the
        wire (the checks' and the apply's CPU then overlap the transfer instead of following
        it). The companion's read runs in a thread; its holding is found as soon as it
        starts (`find`). A read that fails midway leaves what was applied (verified) and the
        rest to be read whole."""
        companion = link.manifest.delta.companion
        outcome: dict[str, Companion | Exception] = {}
        half = deadline.work((deadline.work_end - time.monotonic()) / 2)  # see _apply_links
        end = time.monotonic() + half

        size = companion_bytes(link.manifest.delta)

        def read() -> None:
            try:
                outcome["read"] = self._fetch_companion(
                    companion, link.version, shard, half, True, resolved, size
                )
            except Exception as exc:  # a TensorHubError, or anything else: not read
                outcome["error"] = exc

        reader = threading.Thread(target=read, name=f"delta-{companion}", daemon=True)
        reader.start()
        todo = [index for index in usable if is_base(index)]
        assert self._find is not None
        held = self._find(companion, link.version)
        while held is None and reader.is_alive() and time.monotonic() < end:
            time.sleep(0.002)
            held = self._find(companion, link.version)
        failed: list[int] = []
        done = 0
        if held is not None:
            encoded = Encoded(link.manifest.delta, held.tensors)
            for index in todo:
                if not landed(held, encoded.span(index), end):
                    break
                done += 1
                if not apply_one([link], [encoded], dest, index, kind):
                    failed.append(index)
        reader.join(max(0.0, end - time.monotonic()) + 1.0)
        got = outcome.get("read")
        stats.links = 1
        stats.chunks = done - len(failed)
        stats.whole_chunks = len(_missing(dest, wanted))
        if not isinstance(got, Companion):
            why = outcome.get("error", "it did not end in time")
            stats.fallback = f"{companion}@{link.version} could not be read ({why})"
            return None
        stats.count(got)
        if failed:
            stats.fallback = f"{len(failed)} chunks failed a check after applying: read whole"
        return None if got.held is None else self._keep(got.held)

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


def _missing(dest: HeldVersion, wanted: Collection[int] | None) -> list[int]:
    return [i for i in dest.missing() if wanted is None or i in wanted]


def _nbytes(held: Held) -> int:
    return sum(t.numel() * t.element_size() for t in held.tensors.values())
