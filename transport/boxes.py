"""Boxes of global tensors, for reading a model-parallel version in another layout.

A rank of a tensor-parallel model holds a rectangular block of each global tensor: rows
`[r0, r0 + n)` of a column-parallel weight, columns of a row-parallel one, the whole of a
replicated norm. A `Box` is such a block (an offset and an extent per dimension). A reader
in another layout asks for its own box of each tensor; what it needs from a source rank is
the intersection of the two boxes, and the bytes of that intersection in the source's
row-major tensor lie inside one contiguous span (`byte_span`), so the chunks to fetch are the
chunks of the flat layout that overlap that span (`chunks_for`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tensorhub.errors import InvalidArgument
from transport.layout import Layout, TensorSpec


@dataclass(frozen=True)
class Box:
    """A block of a tensor: `offsets[d] <= i < offsets[d] + shape[d]` in every dimension d."""

    offsets: tuple[int, ...]
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.offsets) != len(self.shape):
            raise InvalidArgument(f"box offsets {self.offsets} and shape {self.shape} differ")
        if any(o < 0 for o in self.offsets) or any(s < 0 for s in self.shape):
            raise InvalidArgument(f"box {self.offsets}+{self.shape} has a negative entry")

    @property
    def volume(self) -> int:
        return math.prod(self.shape)

    def within(self, global_shape: tuple[int, ...]) -> bool:
        """Whether the box lies inside a tensor of `global_shape`."""
        return len(global_shape) == len(self.shape) and all(
            o + s <= g for o, s, g in zip(self.offsets, self.shape, global_shape, strict=True)
        )

    def intersect(self, other: Box) -> Box | None:
        """The common block, or None if they do not overlap (0-d boxes always do)."""
        if len(other.shape) != len(self.shape):
            raise InvalidArgument("boxes of tensors with different ranks")
        lo = tuple(max(a, b) for a, b in zip(self.offsets, other.offsets, strict=True))
        hi = tuple(
            min(a + s, b + t)
            for a, s, b, t in zip(self.offsets, self.shape, other.offsets, other.shape, strict=True)
        )
        if any(h <= lo_ for lo_, h in zip(lo, hi, strict=True)):
            return None
        return Box(lo, tuple(h - lo_ for lo_, h in zip(lo, hi, strict=True)))

    def slices_in(self, outer: Box) -> tuple[slice, ...]:
        """Index of this box inside a tensor that holds `outer` (same global coordinates)."""
        return tuple(
            slice(o - p, o - p + s)
            for o, s, p in zip(self.offsets, self.shape, outer.offsets, strict=True)
        )


def byte_span(held: Box, part: Box, itemsize: int) -> tuple[int, int]:
    """Bytes [first, end) of a row-major tensor holding `held` that contain every element of
    `part` (a box inside `held`, in global coordinates)."""
    if part.volume == 0:
        return 0, 0
    first = last = 0
    for d, extent in enumerate(held.shape):
        first = first * extent + (part.offsets[d] - held.offsets[d])
        last = last * extent + (part.offsets[d] - held.offsets[d] + part.shape[d] - 1)
    return first * itemsize, (last + 1) * itemsize


def chunks_for(layout: Layout, spec: TensorSpec, first: int, end: int) -> range:
    """Indices of the layout's chunks that overlap bytes [first, end) of tensor `spec`."""
    if end <= first:
        return range(0)
    lo = (spec.offset + first) // layout.chunk_size
    hi = (spec.offset + end - 1) // layout.chunk_size
    return range(lo, hi + 1)
