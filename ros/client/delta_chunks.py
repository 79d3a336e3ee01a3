"""A delta's chunk-level work on the reader: where each encoded chunk lies in its
companion's bytes (`Encoded`), whether the destination's chunk is exactly the base
(`BaseCheck`), waiting for an encoded chunk to land (`landed`), and applying a chain of
links to one chunk with every check the format asks for (`apply_one`): the encoded chunk's
digest before it is applied, and the result's checksum after, before the chunk is marked
present. `ros.client.delta_fetch` decides which chunks and links; this module does one."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from ros.proto.tensorhub.v1 import hub_pb2 as pb
from tensorhub.checksum_kinds import KINDS
from tensorhub.delta_rules import TENSOR
from tensorhub.errors import IntegrityError
from transport import delta as codec
from transport.store import HeldVersion

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Link:
    """One delta of a chain: the version it makes and that version's manifest (with its
    delta section against the link before)."""

    version: int
    manifest: pb.Manifest


class Encoded:
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


def apply_one(
    links: list[Link],
    blobs: list[Encoded],
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
