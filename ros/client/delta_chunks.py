"""A delta's chunk-level work on the reader: where each encoded chunk lies in its
companion's bytes (`Encoded`), whether the destination's chunk is exactly the base
(`BaseCheck`), waiting for an encoded chunk to land (`landed`), and applying a chain of
links to one chunk with every check the format asks for (`apply_one`): the encoded chunk's
digest before it is applied, and the result's checksum after (under a linear checksum, its
xxh3-64 too), before the chunk is marked present; and whether a companion is the size its
version's manifest says (`check_companion`), before it is read. `ros.client.delta_fetch`
decides which chunks and links; this module does one."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from ros.proto.tensorhub.v1 import hub_pb2 as pb
from tensorhub.checksum_kinds import LINEAR, XXH3
from tensorhub.delta_rules import TENSOR
from tensorhub.errors import DeltaRefused, IntegrityError
from transport import delta as codec
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

    def span(self, index: int) -> tuple[int, int]:
        """Where chunk `index`'s encoding lies in the companion's bytes: [start, stop)."""
        return self._starts[index], self._starts[index + 1]

    def of(self, index: int) -> memoryview:
        """Chunk `index`'s encoding; `IntegrityError` if the companion does not hold it
        (`DeltaRefused` if it is not exactly as large as the section says)."""
        start, stop = self.span(index)
        if self._data is None:
            raise IntegrityError(f"the companion holds no bytes {start}..{stop}")
        if self._data.numel() != self._starts[-1]:
            raise DeltaRefused(
                f"the companion is {self._data.numel()} bytes, its section {self._starts[-1]}"
            )
        return self._data[start:stop].numpy().data


def apply_one(
    links: list[Link],
    blobs: list[Encoded],
    dest: HeldVersion,
    index: int,
    kind: str,
) -> bool:
    """Apply every link to chunk `index` of `dest`, checking each encoded chunk's digest and
    each result's checksum (the next link's base, at the end the version's, and under a
    linear checksum the xxh3-64 of the version's chunk too: `result_xxh3`); mark it present
    if all pass. False (logged; its memory no longer the base: read whole) if one fails,
    whatever it raised: a chunk that a hostile publisher made to raise anything (a codec's
    error, `MemoryError`, a runtime error) fails alone, and is read whole."""
    final = links[-1].manifest
    parts = dest.chunk_parts(index)
    known: int | None = final.chunk_xxh3[index] if kind == XXH3 else None
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
        if kind in LINEAR:  # the sum alone can be matched on purpose: its xxh3 too
            known = codec.chunk_checksum(dest, index, XXH3)
            if known != final.delta.result_xxh3[index]:
                raise IntegrityError(f"chunk {index} of {links[-1].version}: its xxh3-64")
    except Exception as exc:  # any failure of one chunk: that chunk alone reads whole
        log.warning("delta chunk %d: %s; reading it whole", index, _why(exc))
        return False
    dest.mark_present(index, known)
    return True


def _why(exc: BaseException) -> str:
    """An exception as a log line: its message, or its type when it has none (MemoryError)."""
    return f"{type(exc).__name__}: {exc}" if not isinstance(exc, IntegrityError) else str(exc)


def landed(held: HeldVersion, span: tuple[int, int], end: float) -> bool:
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


class BaseCheck:
    """Whether chunk i of `dest` holds exactly the base (its checksum is the one the
    version's manifest gives the base), each chunk checked once; `mismatch()` is called for
    each chunk that is not (a fetch counts them in its stats)."""

    def __init__(
        self, dest: HeldVersion, sums: Sequence[int], kind: str, mismatch: Callable[[], None]
    ) -> None:
        self._dest, self._sums, self._kind, self._mismatch = dest, sums, kind, mismatch
        self._seen: dict[int, bool] = {}

    def __call__(self, index: int) -> bool:
        seen = self._seen.get(index)
        if seen is None:
            seen = codec.chunk_checksum(self._dest, index, self._kind) == self._sums[index]
            self._seen[index] = seen
            if not seen:
                self._mismatch()
        return seen
