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
   within `hold_bytes` (host memory, over all models), and released with the version.
4. **Apply and verify**: each encoded chunk's digest is checked, it is XORed into T in
   place on T's device (`transport.delta`), and the result must have the checksum of the
   next link's base, and at the end v's own; only then is the chunk marked present, so
   this client serves it. A chunk that fails any check is read whole by the rounds that
   follow, which read exactly the chunks still missing.

Anything that stops the delta (no companion holder left, a companion retired, the deadline
of its part) leaves the chunks not applied to the rounds: slower, never wrong.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

import torch

from ros.client.deadline import Deadline
from ros.client.handles import Held
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from tensorhub.checksum_kinds import KINDS
from tensorhub.delta_rules import ENCODINGS, TENSOR
from tensorhub.errors import IntegrityError, TensorHubError
from transport import delta as codec
from transport.layout import Layout
from transport.store import HeldVersion

log = logging.getLogger(__name__)

MAX_CHAIN = 8  # links a reader follows back to its base; further behind, it reads whole
DEFAULT_HOLD_BYTES = 1 << 30  # host memory a client keeps encoded chunks in to serve them


@dataclass(frozen=True)
class Companion:
    """A companion version read whole: its tensors (the encoded chunks), the bytes that
    crossed, and its `Held` when this client holds and serves it (None: read unheld)."""

    tensors: Mapping[str, torch.Tensor]
    nbytes: int
    held: Held | None = None

    def release(self) -> None:
        if self.held is not None:
            self.held.release(force=True)


FetchCompanion = Callable[[str, int, int | None, float, bool], Companion]
"""Read (model, version, shard, timeout, hold) whole: as a holder that serves it (`hold`),
or unheld (a `fetch_slices` reader, which holds nothing)."""
ResolveManifest = Callable[[str, int, int | None, Deadline], pb.Manifest]
FindHeld = Callable[[str, int], HeldVersion | None]
"""This client's holding of (model, version), if any: how a companion's read is followed."""
"""The manifest of (model, version, shard): how a chain's earlier links are found."""


@dataclass
class DeltaStats:
    """What a fetch's delta did (`Held.delta`); all zero when it read the version whole."""

    base: int = 0  # the version the destination held, that the deltas were applied to
    links: int = 0  # deltas applied one after the other (more than 1: a chain)
    chunks: int = 0  # chunks made from deltas
    encoded_bytes: int = 0  # bytes of the companions read (what crossed the network)
    whole_chunks: int = 0  # chunks left to be read whole (not encoded, or failed a check)
    base_mismatch: int = 0  # of those: the destination's bytes were not exactly the base's
    seconds: float = 0.0  # the delta's part of the fetch: plan, read, apply, verify
    fallback: str = ""  # why the delta was not used, or was used only in part


@dataclass(frozen=True)
class _Link:
    version: int  # the version this link makes
    manifest: pb.Manifest  # its manifest (with the delta section against the link before)


class BaseMemory:
    """Which version the memory of each of this client's fetches holds, by the identity of
    that memory (each tensor's data pointer and size): so that a fetch into the same tensors
    knows its base without the caller saying it. Only a hint: the base is checked chunk by
    chunk against checksums before anything is applied. Thread-safe."""

    def __init__(self) -> None:
        self._seen: dict[tuple[str, int | None], tuple[int, tuple[object, ...]]] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _identity(tensors: Mapping[str, torch.Tensor]) -> tuple[object, ...]:
        return tuple(
            (name, t.device.type, t.data_ptr(), t.numel() * t.element_size())
            for name, t in sorted(tensors.items())
        )

    def remember(
        self, model: str, shard: int | None, version: int, tensors: Mapping[str, torch.Tensor]
    ) -> None:
        with self._lock:
            self._seen[(model, shard)] = (version, self._identity(tensors))

    def version_in(
        self, model: str, shard: int | None, tensors: Mapping[str, torch.Tensor]
    ) -> int | None:
        """The version this client last fetched into exactly these tensors, if it did."""
        with self._lock:
            seen = self._seen.get((model, shard))
        if seen is None or seen[1] != self._identity(tensors):
            return None
        return seen[0]


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
    ) -> Applied:
        """Make what chunks it can of `dest` (memory holding `base`) into `manifest`'s
        version from deltas, marking each present (module docstring); the rest is left
        missing for the fetch's rounds. `chunks`: only these are wanted (`fetch_slices`),
        None: all; `hold`: read the companions as their holder (else unheld, kept nowhere).
        Never raises for a delta that cannot be used: the reason is in the stats."""
        start = time.monotonic()
        stats = DeltaStats(base=base)
        version = dest.key[2]
        try:
            wanted = set(range(len(manifest.chunk_xxh3)) if chunks is None else chunks)
            links = self._chain(
                model, shard, version, dest.layout, manifest, base, deadline, wanted
            )
            kept = self._apply_links(model, shard, links, dest, stats, deadline, wanted, hold)
        except _NoDelta as why:
            stats.fallback = str(why)
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
    ) -> list[_Link]:
        """The links from `base` to `version`, oldest first; `_NoDelta` if there is none or
        it would move as many bytes as the whole version."""
        if base >= version:
            raise _NoDelta(f"the destination holds {base}, not an earlier version")
        links = [_Link(version, manifest)]
        while links[-1].manifest.delta.base != base:
            head = links[-1]
            if not head.manifest.HasField("delta"):
                raise _NoDelta(f"{head.version} was published without a delta")
            if head.manifest.delta.base < base or len(links) >= MAX_CHAIN:
                raise _NoDelta(f"no chain of at most {MAX_CHAIN} deltas leads from {base}")
            earlier = head.manifest.delta.base
            try:
                links.append(_Link(earlier, self._resolve(model, earlier, shard, deadline)))
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
    def _usable(links: list[_Link], wanted: set[int]) -> set[int]:
        """The wanted chunks every link encodes (one sent whole by any link is read whole)."""
        return {i for i in wanted if all(k.manifest.delta.encoded_bytes[i] for k in links)}

    def _apply_links(
        self,
        model: str,
        shard: int | None,
        links: list[_Link],
        dest: HeldVersion,
        stats: DeltaStats,
        deadline: Deadline,
        wanted: set[int],
        hold: bool,
    ) -> Held | None:
        kind = links[-1].manifest.checksum or KINDS[0]
        usable = sorted(self._usable(links, wanted))
        is_base = _BaseCheck(dest, links[0].manifest.delta.base_checksum, kind, stats)
        if len(links) == 1 and hold and self._find is not None and usable and is_base(usable[0]):
            # the memory is the base where it starts: the rest is checked while the delta
            # is on its way (a memory that is not the base at all reads whole at once)
            return self._apply_streaming(
                links[0], shard, dest, usable, is_base, kind, stats, deadline, wanted
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
                    read = self._fetch_companion(companion, link.version, shard, half, hold)
                except TensorHubError as exc:
                    raise _NoDelta(f"{companion}@{link.version} could not be read ({exc})") from exc
                companions.append(read)
                stats.encoded_bytes += read.nbytes
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
        links: list[_Link],
        companions: list[Companion],
        dest: HeldVersion,
        todo: list[int],
        kind: str,
    ) -> list[int]:
        """Apply every link to each chunk of `todo`, verifying as it goes; mark each chunk
        that ends as the version's present. The chunks that failed a check (left missing,
        their memory no longer the base: the rounds read them whole)."""
        pairs = zip(links, companions, strict=True)
        blobs = [_Encoded(link.manifest.delta, read.tensors) for link, read in pairs]
        return [index for index in todo if not _apply_one(links, blobs, dest, index, kind)]

    def _apply_streaming(
        self,
        link: _Link,
        shard: int | None,
        dest: HeldVersion,
        usable: list[int],
        is_base: _BaseCheck,
        kind: str,
        stats: DeltaStats,
        deadline: Deadline,
        wanted: set[int],
    ) -> Held | None:
        """One link, read as its holder: check which of the `usable` chunks of `dest` are
        the base while the companion is being found and read, and apply each as soon as its
        encoded bytes have landed in the companion's memory, while the rest are still on the
        wire (the checks' and the apply's CPU then overlap the transfer instead of following
        it). The companion's read runs in a thread; its holding is found as soon as it
        starts (`find`). A read that fails midway leaves what was applied (verified) and the
        rest to be read whole."""
        companion = link.manifest.delta.companion
        outcome: dict[str, Companion | TensorHubError] = {}
        half = deadline.work((deadline.work_end - time.monotonic()) / 2)  # see _apply_links
        end = time.monotonic() + half

        def read() -> None:
            try:
                outcome["read"] = self._fetch_companion(companion, link.version, shard, half, True)
            except TensorHubError as exc:
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
            encoded = _Encoded(link.manifest.delta, held.tensors)
            for index in todo:
                if not _landed(held, encoded.span(index), end):
                    break
                done += 1
                if not _apply_one([link], [encoded], dest, index, kind):
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
        stats.encoded_bytes += got.nbytes
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


@dataclass
class Staged:
    """A `fetch_slices` staging copy kept as the base of the next one (`delta=True`): the
    version it holds, its layout, its tensors, which chunks are filled, and the companion
    its delta came with (served until the copy is replaced or dropped)."""

    version: int
    layout: Layout
    tensors: dict[str, torch.Tensor]
    filled: frozenset[int]
    companion: Held | None = None

    def drop(self) -> None:
        if self.companion is not None:
            self.companion.release(force=True)


class StagedBases:
    """Per (model, source shard): the staging copy a `fetch_slices(delta=True)` left. A
    fetch takes it (so two at once never share one) and puts back what it ends with.
    Thread-safe."""

    def __init__(self) -> None:
        self._kept: dict[tuple[str, int | None], Staged] = {}
        self._lock = threading.Lock()

    def take(self, model: str, shard: int | None) -> Staged | None:
        with self._lock:
            return self._kept.pop((model, shard), None)

    def put(self, model: str, shard: int | None, staged: Staged) -> None:
        with self._lock:
            old = self._kept.pop((model, shard), None)
            self._kept[(model, shard)] = staged
        if old is not None and old.companion is not staged.companion:
            old.drop()

    def drop(self, model: str | None) -> None:
        """Free the copies of `model` (None: all) and release their companions."""
        with self._lock:
            gone = [k for k in self._kept if model is None or k[0] == model]
            dropped = [self._kept.pop(k) for k in gone]
        for staged in dropped:
            staged.drop()

    def nbytes(self) -> int:
        """Host and device memory the kept copies take (what `delta=True` costs)."""
        with self._lock:
            return sum(k.layout.total_bytes for k in self._kept.values())


class _Encoded:
    """A link's encoded chunks: its companion's one tensor (`delta_rules.TENSOR`), chunk i
    at the sum of the encoded sizes before it."""

    def __init__(self, section: pb.Delta, tensors: Mapping[str, torch.Tensor]) -> None:
        self._data = tensors.get(TENSOR)
        self._starts = list(itertools.accumulate(section.encoded_bytes, initial=0))

    def span(self, index: int) -> tuple[int, int]:
        """Where chunk `index`'s encoding lies in the companion's bytes: [start, stop)."""
        return self._starts[index], self._starts[index + 1]

    def of(self, index: int) -> memoryview:
        """Chunk `index`'s encoding; `IntegrityError` if the companion does not hold it."""
        start, stop = self.span(index)
        if self._data is None or self._data.numel() < stop:
            raise IntegrityError(f"the companion holds no bytes {start}..{stop}")
        return self._data[start:stop].numpy().data


def _apply_one(
    links: list[_Link],
    blobs: list[_Encoded],
    dest: HeldVersion,
    index: int,
    kind: str,
) -> bool:
    """Apply every link to chunk `index` of `dest`, checking each encoded chunk's digest and
    each result's checksum (the next link's base, at the end the version's); mark it present
    if all pass. False (logged; its memory no longer the base: read whole) if one fails."""
    final = links[-1].manifest
    parts = dest.chunk_parts(index)
    try:
        for step, (link, encoded) in enumerate(zip(links, blobs, strict=True)):
            blob = encoded.of(index)
            if codec.digest(blob) != link.manifest.delta.encoded_xxh3[index]:
                raise IntegrityError(f"encoded chunk {index} of {link.version}: digest")
            codec.apply(parts, blob, link.manifest.delta.encoding)
            want = (
                links[step + 1].manifest.delta.base_checksum[index]
                if step + 1 < len(links)
                else final.chunk_xxh3[index]
            )
            if codec.chunk_checksum(dest, index, kind) != want:
                raise IntegrityError(f"chunk {index} of {link.version}: checksum")
    except IntegrityError as exc:
        log.warning("delta chunk %d: %s; reading it whole", index, exc)
        return False
    dest.mark_present(index, final.chunk_xxh3[index] if kind == KINDS[0] else None)
    return True


def _landed(held: HeldVersion, span: tuple[int, int], end: float) -> bool:
    """Wait until every chunk of `held` (a companion) that bytes [start, stop) of its one
    tensor lie in is present (False if the read failed, was released, or `end` passed
    first, or it has no such bytes)."""
    spec = next((s for s in held.layout.tensors if s.name == TENSOR), None)
    start, stop = span
    if spec is None or spec.nbytes < stop:
        return False
    size = held.layout.chunk_size
    first, last = (spec.offset + start) // size, (spec.offset + max(stop, start + 1) - 1) // size
    chunks = range(first, last + 1)
    return all(held.wait_present(c, max(0.0, end - time.monotonic())) for c in chunks)


class _BaseCheck:
    """Whether chunk i of `dest` holds exactly the base (its checksum is the one the
    version's manifest gives the base), each chunk checked once; a mismatch is counted in
    `stats.base_mismatch`."""

    def __init__(self, dest: HeldVersion, sums: Sequence[int], kind: str, stats: DeltaStats):
        self._dest, self._sums, self._kind, self._stats = dest, sums, kind, stats
        self._seen: dict[int, bool] = {}

    def __call__(self, index: int) -> bool:
        seen = self._seen.get(index)
        if seen is None:
            seen = codec.chunk_checksum(self._dest, index, self._kind) == self._sums[index]
            self._seen[index] = seen
            if not seen:
                self._stats.base_mismatch += 1
        return seen


class _NoDelta(Exception):
    """Why a delta cannot be used: the version is read whole (never raised out of here)."""


def _missing(dest: HeldVersion, wanted: Collection[int] | None) -> list[int]:
    return [i for i in dest.missing() if wanted is None or i in wanted]


def _nbytes(held: Held) -> int:
    return sum(t.numel() * t.element_size() for t in held.tensors.values())
