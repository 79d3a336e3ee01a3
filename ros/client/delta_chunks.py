"""A delta's chunk-level work on the reader: where each encoded chunk lies in its
companion's bytes (`Encoded`), whether the destination's chunk is exactly the base
(`BaseCheck`), whether an encoded chunk has landed (`landed`), and applying a chain of
links to one chunk with every check the format asks for (`apply_one`): the encoded chunk's
digest before it is applied, and the result's checksum after (under a linear checksum, its
xxh3-64 too), before the chunk is marked present; and whether a companion is the size its
version's manifest says (`check_companion`), before it is read. `ros.client.delta_fetch`
decides which chunks and links; this module does one.

Each chunk's bytes are read once to check it: the result's checksum is the check that the
destination was the base (a destination that was not cannot end on the version's bytes);
the base's own checksum is computed only to say why a chunk failed (after undoing it), and
for the one chunk a fetch samples before it reads any companion."""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from ros.proto.tensorhub.v1 import hub_pb2 as pb
from tensorhub.checksum_kinds import LINEAR, XXH3
from tensorhub.delta_rules import ENCODING, TENSOR
from tensorhub.errors import DeltaRefused, IntegrityError
from transport import delta as codec
from transport import delta_words
from transport.store import HeldVersion

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Link:
    """One delta of a chain: the version it makes and that version's manifest (with its
    delta section against the link before)."""

    version: int
    manifest: pb.Manifest


def companion_bytes(section: pb.Delta) -> int:
    """The size of the companion a delta section describes: its encoded chunks, back to back."""
    return sum(int(n) for n in section.encoded_bytes)


def check_companion(manifest: pb.Manifest, nbytes: int, what: str) -> None:
    """`DeltaRefused` unless `manifest` (a companion's) is one uint8 tensor `TENSOR` of exactly
    `nbytes` bytes, the sum of the encoded sizes its version's manifest states: checked
    before anything of it is read, so a companion padded (or cut) to another size is never
    downloaded nor kept (issue 38: one padded to 512 MiB for an 8 MiB version was)."""
    tensors = [(t.name, t.dtype, list(t.shape), int(t.nbytes)) for t in manifest.tensors]
    if tensors != [(TENSOR, "uint8", [nbytes], nbytes)] or manifest.total_bytes != nbytes:
        raise DeltaRefused(
            f"{what} is {manifest.total_bytes} bytes in {len(tensors)} tensors; its version's "
            f"manifest encodes {nbytes} bytes in one uint8 tensor {TENSOR!r}: not read"
        )


class Encoded:
    """A link's encoded chunks: its companion's one tensor (`delta_rules.TENSOR`), chunk i
    at the sum of the encoded sizes before it. A companion of another size than those sum
    to gives none (`of` raises)."""

    def __init__(self, section: pb.Delta, tensors: Mapping[str, torch.Tensor]) -> None:
        self._data = tensors.get(TENSOR)
        self._starts = list(itertools.accumulate(section.encoded_bytes, initial=0))
        self.digests = list(section.encoded_xxh3)  # each encoded chunk's, as the manifest's
        self._bytes: memoryview | None = None  # the companion's bytes once their size checked

    def span(self, index: int) -> tuple[int, int]:
        """Where chunk `index`'s encoding lies in the companion's bytes: [start, stop)."""
        return self._starts[index], self._starts[index + 1]

    def of(self, index: int) -> memoryview:
        """Chunk `index`'s encoding (a view of the companion's memory, no copy);
        `IntegrityError` if the companion does not hold it (`DeltaRefused` if it is not
        exactly as large as the section says)."""
        start, stop = self._starts[index], self._starts[index + 1]
        found = self._bytes
        if found is None:
            if self._data is None:
                raise IntegrityError(f"the companion holds no bytes {start}..{stop}")
            if self._data.numel() != self._starts[-1]:
                raise DeltaRefused(
                    f"the companion is {self._data.numel()} bytes, its section {self._starts[-1]}"
                )
            found = self._bytes = self._data.numpy().data  # one view, sliced for each chunk
        return found[start:stop]


def apply_one(
    links: list[Link],
    blobs: list[Encoded],
    dest: HeldVersion,
    index: int,
    kind: str,
    base: BaseCheck | None = None,
) -> bool:
    """Apply every link to chunk `index` of `dest` and mark it present if the result is the
    version's: each encoded chunk's digest is checked before it is applied, and the result
    once, at the end, by its checksum (under a linear checksum, by its xxh3-64 too:
    `result_xxh3`). That one check of the result is what makes the chunk trusted: a
    destination that was not exactly the base cannot end on the version's bytes. When a
    check fails or anything raises (a codec's error, `MemoryError`, a runtime error: a chunk
    that a hostile publisher made to raise fails alone), the links applied are undone
    (applying an XOR again restores the base) and, with `base`, the chunk is checked
    against the base to count a destination that was not it; False (logged): the chunk is
    read whole."""
    final = links[-1].manifest
    parts = dest.chunk_parts(index)
    done: list[tuple[memoryview, str]] = []
    try:
        for link, encoded in zip(links, blobs, strict=True):
            blob = encoded.of(index)
            if codec.digest(blob) != encoded.digests[index]:
                raise IntegrityError(f"encoded chunk {index} of {link.version}: digest")
            encoding = link.manifest.delta.encoding
            codec.apply(parts, blob, encoding)
            done.append((blob, encoding))
        known = _check_result(dest, index, kind, links[-1].version, final)
    except Exception as exc:  # any failure of one chunk: that chunk alone reads whole
        log.warning("delta chunk %d: %s; reading it whole", index, _why(exc))
        if _undo(parts, done, index) and base is not None:
            base(index)  # counts a destination that was not the base
        return False
    dest.mark_present(index, known)
    return True


def apply_many(
    links: list[Link],
    blobs: list[Encoded],
    dest: HeldVersion,
    indices: Sequence[int],
    kind: str,
    base: BaseCheck | None = None,
) -> int:
    """`apply_one` of each chunk of `indices` (its checks, outcome and undo); how many were
    made. Where the chunks are host memory and one link of `ENCODING` changes them in its
    changed-words form (every chunk of a `bench delta` step at lr 1e-6), their encodings
    are decoded together (`transport.delta.decode_words`): a step's hundreds of small
    chunks otherwise cost a dozen numpy calls each to decode, as much as their work. Each
    chunk's digest is checked before it is decoded and its result after it is applied, as
    `apply_one` does; any other chunk, and any the joint decode refuses, goes through
    `apply_one` itself (which refuses it again, logs it, and checks it against the base)."""
    if len(links) > 1 or dest.on_cuda or links[0].manifest.delta.encoding != ENCODING:
        return sum(apply_one(links, blobs, dest, i, kind, base) for i in indices)
    encoded = blobs[0]
    alone: list[int] = []  # each applied by apply_one
    found: list[tuple[int, list[memoryview]]] = []
    chunks: list[memoryview] = []
    for index in indices:
        try:
            views = dest.source_views(index)
            blob = encoded.of(index)
            if any(len(v) % 2 for v in views) or codec.digest(blob) != encoded.digests[index]:
                alone.append(index)
                continue
        except Exception:  # apply_one raises it again, and says why
            alone.append(index)
            continue
        found.append((index, views))
        chunks.append(blob)
    try:
        decoded = codec.decode_words(chunks, [sum(len(v) for v in views) for _, views in found])
    except Exception:  # no refusal (each is the chunk's own): each chunk alone
        decoded = [IntegrityError("not decoded")] * len(found)
    made = 0
    final = links[-1]
    for (index, views), got in zip(found, decoded, strict=True):
        if isinstance(got, IntegrityError):
            alone.append(index)
        else:
            made += _apply_words(dest, index, views, got, kind, final, base)
    return made + sum(apply_one(links, blobs, dest, i, kind, base) for i in alone)


def _apply_words(
    dest: HeldVersion,
    index: int,
    views: list[memoryview],
    decoded: delta_words.Decoded,
    kind: str,
    link: Link,
    base: BaseCheck | None,
) -> bool:
    """`apply_one`'s apply, check and undo of chunk `index` (in host memory: `views`) from
    its decoded changed words: True once marked present."""
    applied = False
    try:
        codec.apply_words(views, decoded)
        applied = True
        known = _check_result(dest, index, kind, link.version, link.manifest)
    except Exception as exc:  # as apply_one: that chunk alone reads whole
        log.warning("delta chunk %d: %s; reading it whole", index, _why(exc))
        try:
            if applied:  # the XOR again: the chunk holds what it held before
                codec.apply_words(views, decoded)
        except Exception as undo:
            log.warning("delta chunk %d: undoing it: %s", index, _why(undo))
            return False
        if base is not None:
            base(index)  # counts a destination that was not the base
        return False
    dest.mark_present(index, known)
    return True


def _check_result(
    dest: HeldVersion, index: int, kind: str, version: int, manifest: pb.Manifest
) -> int:
    """The xxh3-64 of chunk `index` of `dest` if it is the chunk `manifest` gives (its
    checksum, and under a linear checksum its xxh3-64 too); else `IntegrityError`."""
    if kind not in LINEAR:
        known = codec.chunk_checksum(dest, index, XXH3)
        if known != manifest.chunk_xxh3[index]:
            raise IntegrityError(f"chunk {index} of {version}: checksum")
        return known
    # the sum alone can be matched on purpose: its xxh3 is the check that holds
    known = codec.chunk_checksum(dest, index, XXH3)
    if known != manifest.delta.result_xxh3[index]:
        raise IntegrityError(f"chunk {index} of {version}: its xxh3-64")
    if codec.chunk_checksum(dest, index, kind) != manifest.chunk_xxh3[index]:
        raise IntegrityError(f"chunk {index} of {version}: checksum")
    return known


def _undo(parts: list[torch.Tensor], done: list[tuple[memoryview, str]], index: int) -> bool:
    """Apply the links in `done` again, last first (each an XOR: applied twice, it is gone),
    so the chunk holds what it held before; False (logged) if that failed too."""
    try:
        for blob, encoding in reversed(done):
            codec.apply(parts, blob, encoding)
    except Exception as exc:  # the chunk is read whole either way
        log.warning("delta chunk %d: undoing it: %s", index, _why(exc))
        return False
    return True


def _why(exc: BaseException) -> str:
    """An exception as a log line: its message, or its type when it has none (MemoryError)."""
    return f"{type(exc).__name__}: {exc}" if not isinstance(exc, IntegrityError) else str(exc)


def landed(held: HeldVersion, span: tuple[int, int]) -> bool:
    """Whether every chunk of `held` (a companion) that bytes [start, stop) of its one
    tensor lie in is present now (False if it has no such bytes)."""
    spec = next((s for s in held.layout.tensors if s.name == TENSOR), None)
    start, stop = span
    if spec is None or spec.nbytes < stop:
        return False
    size = held.layout.chunk_size
    first, last = (spec.offset + start) // size, (spec.offset + max(stop, start + 1) - 1) // size
    return all(held.is_present(c) for c in range(first, last + 1))


class BaseCheck:
    """Whether chunk i of `dest` holds exactly the base (its checksum is the one the
    version's manifest gives the base), each chunk checked once; `mismatch()` is called for
    each chunk that is not (a fetch counts them in its stats). Thread-safe."""

    def __init__(
        self, dest: HeldVersion, sums: Sequence[int], kind: str, mismatch: Callable[[], None]
    ) -> None:
        self._dest, self._sums, self._kind, self._mismatch = dest, sums, kind, mismatch
        self._seen: dict[int, bool] = {}
        self._lock = threading.Lock()  # chunks are checked on several threads

    def __call__(self, index: int) -> bool:
        seen = self._seen.get(index)
        if seen is None:
            seen = codec.chunk_checksum(self._dest, index, self._kind) == self._sums[index]
            with self._lock:
                if index not in self._seen:
                    self._seen[index] = seen
                    if not seen:
                        self._mismatch()
        return seen
