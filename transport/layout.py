"""Flat address-space layout of a model's tensors, and its cut into chunks.

A publisher lays every tensor of a version into one flat address space (offsets aligned
to `ALIGN` bytes, tensors packed back to back), then cuts that space into fixed-size
chunks. Chunks are the unit of planning, transfer and checksum: a model with thousands of
tiny tensors costs a handful of chunk round trips, not one per tensor. Padding between
tensors is never sent; a chunk's wire payload is the concatenation of the tensor bytes
that fall inside it (its *segments*).
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
import xxhash

from tensorhub.errors import InvalidArgument, OutOfMemory

DEFAULT_CHUNK = 4 * 1024 * 1024
"""Default chunk size: large enough to amortise per-chunk overhead, small enough to spread."""

ALIGN = 64
"""Every tensor starts on a multiple of this (a cache line; also what DMA engines like)."""

MIN_CHUNK = 4096
MAX_CHUNK = 1 << 30


@dataclass(frozen=True)
class TensorSpec:
    """One tensor's place in the flat space: `nbytes` bytes starting at `offset`."""

    name: str
    dtype: str  # torch dtype name, e.g. "float32"
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Chunk:
    """Bytes [offset, offset + length) of the flat space; `index` is its wire identity."""

    index: int
    offset: int
    length: int


@dataclass(frozen=True)
class Segment:
    """The part of one tensor inside one chunk: `length` bytes from byte `start` of tensor
    number `tensor` (its index in `Layout.tensors`)."""

    tensor: int
    start: int
    length: int


def dtype_name(dtype: torch.dtype) -> str:
    """The manifest spelling of a torch dtype: `torch.float32` -> `"float32"`."""
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype named `name`, or `InvalidArgument` (names come from manifests)."""
    dtype = getattr(torch, name, None) if name.isidentifier() else None
    if not isinstance(dtype, torch.dtype):
        raise InvalidArgument(f"unknown dtype {name!r} in layout")
    return dtype


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class Layout:
    """Where each tensor of a version lives in the flat space, and the chunk size."""

    tensors: tuple[TensorSpec, ...]
    total_bytes: int
    chunk_size: int = DEFAULT_CHUNK

    def __post_init__(self) -> None:
        if not MIN_CHUNK <= self.chunk_size <= MAX_CHUNK or self.chunk_size % ALIGN:
            raise InvalidArgument(
                f"chunk_size {self.chunk_size} must be a multiple of {ALIGN} "
                f"between {MIN_CHUNK} and {MAX_CHUNK}"
            )
        end = 0
        names: set[str] = set()
        for spec in self.tensors:
            if spec.name in names:
                raise InvalidArgument(f"duplicate tensor name {spec.name!r} in layout")
            names.add(spec.name)
            itemsize = torch.empty((), dtype=torch_dtype(spec.dtype)).element_size()
            count = 1
            for dim in spec.shape:
                if dim < 0:
                    raise InvalidArgument(f"tensor {spec.name!r}: negative dimension")
                count *= dim
            if spec.nbytes != count * itemsize:
                raise InvalidArgument(f"tensor {spec.name!r}: nbytes does not match shape/dtype")
            if spec.offset < end or spec.offset % ALIGN:
                raise InvalidArgument(f"tensor {spec.name!r}: overlapping or unaligned offset")
            end = spec.offset + spec.nbytes
        if self.total_bytes < end:
            raise InvalidArgument("layout total_bytes is smaller than its last tensor's end")

    @classmethod
    def from_tensors(
        cls, tensors: Mapping[str, torch.Tensor], chunk_size: int = DEFAULT_CHUNK
    ) -> Layout:
        """Pack `tensors` (in mapping order) into one flat space with aligned offsets."""
        specs: list[TensorSpec] = []
        offset = 0
        for name, t in tensors.items():
            if not isinstance(t, torch.Tensor):
                raise InvalidArgument(f"{name!r} is not a tensor")
            nbytes = t.numel() * t.element_size()
            specs.append(TensorSpec(name, dtype_name(t.dtype), tuple(t.shape), offset, nbytes))
            offset = _align(offset + nbytes)
        total = specs[-1].offset + specs[-1].nbytes if specs else 0
        return cls(tuple(specs), total, chunk_size)

    @property
    def num_chunks(self) -> int:
        return (self.total_bytes + self.chunk_size - 1) // self.chunk_size

    def chunks(self) -> list[Chunk]:
        """All chunks in order; the last one may be short."""
        size, total = self.chunk_size, self.total_bytes
        return [Chunk(i, o, min(size, total - o)) for i, o in enumerate(range(0, total, size))]

    @cached_property
    def _starts(self) -> list[int]:
        return [s.offset for s in self.tensors]

    def segments(self, index: int) -> list[Segment]:
        """The tensor bytes inside chunk `index`, in address order (padding excluded)."""
        self._check_index(index)
        lo = index * self.chunk_size
        hi = min(lo + self.chunk_size, self.total_bytes)
        out: list[Segment] = []
        i = max(bisect.bisect_right(self._starts, lo) - 1, 0)
        while i < len(self.tensors) and self.tensors[i].offset < hi:
            spec = self.tensors[i]
            a, b = max(lo, spec.offset), min(hi, spec.offset + spec.nbytes)
            if b > a:
                out.append(Segment(i, a - spec.offset, b - a))
            i += 1
        return out

    def _check_index(self, index: int) -> None:
        if not 0 <= index < self.num_chunks:
            raise InvalidArgument(f"chunk {index} out of range (0..{self.num_chunks - 1})")

    def payload_bytes(self, index: int) -> int:
        """How many bytes chunk `index` carries on the wire."""
        self._check_index(index)
        return self._payloads[index]

    @cached_property
    def _payloads(self) -> list[int]:
        """Every chunk's payload size, in one pass over the tensors (a reader asks for each
        chunk's several times; finding its segments each time was a fetch's hot spot)."""
        sizes = [0] * self.num_chunks
        size = self.chunk_size
        for spec in self.tensors:
            at, end = spec.offset, spec.offset + spec.nbytes
            while at < end:
                upto = min(end, (at // size + 1) * size)
                sizes[at // size] += upto - at
                at = upto
        return sizes

    @cached_property
    def digest(self) -> int:
        """xxh3-64 of the canonical JSON form: reader and holder must agree on it."""
        text = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return int(xxhash.xxh3_64_intdigest(text.encode()))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe form for the manifest."""
        return {
            "total_bytes": self.total_bytes,
            "chunk_size": self.chunk_size,
            "tensors": [
                {
                    "name": s.name,
                    "dtype": s.dtype,
                    "shape": list(s.shape),
                    "offset": s.offset,
                    "nbytes": s.nbytes,
                }
                for s in self.tensors
            ],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Layout:
        """Inverse of `to_dict`; malformed input raises `InvalidArgument`."""
        try:
            specs = tuple(
                TensorSpec(
                    str(t["name"]),
                    str(t["dtype"]),
                    tuple(int(d) for d in t["shape"]),
                    int(t["offset"]),
                    int(t["nbytes"]),
                )
                for t in data["tensors"]
            )
            return cls(specs, int(data["total_bytes"]), int(data["chunk_size"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidArgument(f"malformed layout: {exc!r}") from exc

    def check_tensors(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Raise `InvalidArgument` naming the first mismatch between `tensors` and this layout
        (missing or extra name, dtype, shape, non-contiguous); called before any byte lands."""
        expected = {s.name for s in self.tensors}
        missing = sorted(expected - tensors.keys())
        extra = sorted(tensors.keys() - expected)
        if missing or extra:
            raise InvalidArgument(f"tensor names differ: missing {missing[:5]}, extra {extra[:5]}")
        for spec in self.tensors:
            t = tensors[spec.name]
            if dtype_name(t.dtype) != spec.dtype:
                raise InvalidArgument(
                    f"tensor {spec.name!r}: dtype {dtype_name(t.dtype)}, layout has {spec.dtype}"
                )
            if tuple(t.shape) != spec.shape:
                raise InvalidArgument(
                    f"tensor {spec.name!r}: shape {tuple(t.shape)}, layout has {spec.shape}"
                )
            if not t.is_contiguous():
                raise InvalidArgument(f"tensor {spec.name!r} is not contiguous")

    def allocate(self, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """Fresh (uninitialised) tensors matching this layout, in layout order;
        `OutOfMemory` (not torch's bare RuntimeError) if they do not fit."""
        try:
            return {
                s.name: torch.empty(s.shape, dtype=torch_dtype(s.dtype), device=device)
                for s in self.tensors
            }
        except RuntimeError as exc:  # torch.OutOfMemoryError is one too
            raise OutOfMemory(
                f"cannot allocate {self.total_bytes} bytes of tensors on {device}: {exc}"
            ) from exc
