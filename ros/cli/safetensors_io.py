"""The safetensors format, read memory-mapped and written in pieces.

`tensorhub publish` serves a checkpoint from its files, so it maps them instead of loading
them: `map_file` checks the header and returns tensors that are views of a private mapping of
the file (the page cache: nothing is copied, and untouched pages cost no memory).
`tensorhub fetch` writes a file tensor by tensor, and block by block within a large tensor,
as the pieces arrive: `header_bytes` lays out the header first, and the caller appends the
data in the order the header gives.

Every refusal is `InvalidArgument` naming the file and what is wrong with it, raised before
anything reaches the hub. A header is someone else's JSON: its size, nesting, keys and
values are bounded before it is parsed (`ros.cli.untrusted_json`), so that it can name at
most the tensors the checkpoint has left of `MAX_TENSORS`; its integers have at most 20
digits, a shape at most `MAX_DIMS` dimensions. The layout rules are the format's: an
8-byte little-endian header length, a JSON header (`__metadata__` of strings, then
name -> dtype, shape, data_offsets), data that the offsets cover exactly, in order, without
holes. Files written here put the tensors of larger elements first (each tensor then
starts on a multiple of its element size, so any reader may view it in place), pad the
header with spaces to a multiple of 8, and say `"format": "pt"`, which `transformers` asks
for; they never name a tensor `__metadata__` (the manifest check refuses that name).
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ros.cli.untrusted_json import Limits, load
from ros.manifest_check import MAX_DIMS, RESERVED_TENSOR_NAMES
from tensorhub.errors import InvalidArgument

MAX_HEADER_BYTES = 100 << 20  # the reference implementation's own limit
MAX_TENSORS = 1 << 18  # tensors in one checkpoint, all its files together
MAX_METADATA_KEYS = 1024  # entries of one header's __metadata__ (beyond its tensors' keys)
_ALIGN = 8

# safetensors dtype name <-> torch dtype (the names the format defines that torch has)
DTYPES: Mapping[str, torch.dtype] = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16,
    "U16": torch.uint16, "F16": torch.float16, "BF16": torch.bfloat16, "I32": torch.int32,
    "U32": torch.uint32, "F32": torch.float32, "F64": torch.float64, "I64": torch.int64,
    "U64": torch.uint64, "C64": torch.complex64, "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E8M0": torch.float8_e8m0fnu,
}  # fmt: skip
NAMES: Mapping[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}


@dataclass(frozen=True)
class Entry:
    """One tensor of a file: its dtype, shape and byte range within the data section."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Header:
    """A file's parsed header: where its data begins, its tensors in data order, and the
    `__metadata__` strings."""

    data_start: int
    entries: tuple[Entry, ...]
    metadata: Mapping[str, str]

    @property
    def data_bytes(self) -> int:
        return self.entries[-1].end if self.entries else 0


def looks_like_safetensors(head: bytes) -> bool:
    """Whether the first bytes of a file could start a safetensors header (`{` after the
    8-byte length), to tell it from a torch file before reading further."""
    if len(head) < 9:
        return False
    (size,) = struct.unpack("<Q", head[:8])
    return 2 <= size <= MAX_HEADER_BYTES and head[8:9] == b"{"


def header_limits(tensors: int) -> Limits:
    """The bounds of a header naming at most `tensors` tensors: a tensor's entry has 4 keys
    (its name, dtype, shape, data_offsets) and 10 values plus one a dimension (32 a tensor
    leave room for 22 dimensions on average); `__metadata__` may add `MAX_METADATA_KEYS`
    strings. Depth 3: the header, an entry, its shape."""
    return Limits(
        max_bytes=MAX_HEADER_BYTES,
        max_depth=3,
        max_members=4 * tensors + MAX_METADATA_KEYS + 1,
        max_values=32 * tensors + 2 * MAX_METADATA_KEYS + 2,
    )


def read_header(path: Path, max_tensors: int = MAX_TENSORS) -> Header:
    """Parse and check `path`'s header against the file's size (`InvalidArgument` if it is
    not a safetensors file, or a broken one, or one that names more than `max_tensors`
    tensors: refused, with every other bound of `header_limits`, before it is parsed)."""
    try:
        with open(path, "rb") as f:
            prefix = f.read(8)
            size = os.fstat(f.fileno()).st_size
            if len(prefix) < 8:
                raise InvalidArgument(f"{path}: not a safetensors file ({size} bytes)")
            (length,) = struct.unpack("<Q", prefix)
            if not 2 <= length <= min(MAX_HEADER_BYTES, size - 8):
                raise InvalidArgument(
                    f"{path}: not a safetensors file (header length {length}, file {size} bytes)"
                )
            raw = f.read(length)
    except OSError as exc:
        raise InvalidArgument(f"{path}: cannot read it: {exc.strerror or exc}") from None
    parsed = load(raw, f"{path}: bad safetensors header", header_limits(max_tensors))
    if not isinstance(parsed, dict):
        raise InvalidArgument(f"{path}: not a safetensors file (the header is no JSON object)")
    if len(parsed) - ("__metadata__" in parsed) > max_tensors:
        raise InvalidArgument(
            f"{path}: names {len(parsed)} tensors, more than the checkpoint's {max_tensors} "
            f"left of {MAX_TENSORS}"
        )
    header = _entries(path, parsed, 8 + length)
    if header.data_start + header.data_bytes != size:
        raise InvalidArgument(
            f"{path}: the header covers {header.data_bytes} data bytes, the file has "
            f"{size - header.data_start}: truncated or padded"
        )
    return header


def _entries(path: Path, parsed: dict[str, object], data_start: int) -> Header:
    metadata = parsed.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise InvalidArgument(f"{path}: __metadata__ must map names to strings")
    entries = []
    for name, spec in parsed.items():
        if not isinstance(spec, dict):
            raise InvalidArgument(f"{path}: tensor {name!r}: no dtype/shape/data_offsets")
        dtype, shape, offsets = spec.get("dtype"), spec.get("shape"), spec.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise InvalidArgument(f"{path}: tensor {name!r}: unknown dtype {dtype!r:.40}")
        if not (
            isinstance(shape, list)
            and len(shape) <= MAX_DIMS
            and all(type(d) is int and d >= 0 for d in shape)
        ):
            raise InvalidArgument(f"{path}: tensor {name!r}: bad shape {shape!r:.80}")
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(type(o) is int for o in offsets)
            and 0 <= offsets[0] <= offsets[1]
        ):
            raise InvalidArgument(f"{path}: tensor {name!r}: bad data_offsets {offsets!r}")
        entry = Entry(name, DTYPES[str(dtype)], tuple(shape), offsets[0], offsets[1])
        numel = 1
        for d in entry.shape:
            numel *= d
        if numel * entry.dtype.itemsize != entry.nbytes:
            raise InvalidArgument(
                f"{path}: tensor {name!r}: {entry.nbytes} bytes for shape {list(shape)} of {dtype}"
            )
        entries.append(entry)
    entries.sort(key=lambda e: (e.start, e.end))
    at = 0
    for e in entries:
        if e.start != at:
            raise InvalidArgument(
                f"{path}: tensor {e.name!r} starts at {e.start}, expected {at} "
                "(overlapping data, or a hole)"
            )
        at = e.end
    return Header(data_start, tuple(entries), dict(metadata))


def map_file(path: Path, max_tensors: int = MAX_TENSORS) -> tuple[Header, dict[str, torch.Tensor]]:
    """The tensors of `path` as views of a private, copy-on-write mapping of it (nothing is
    read until used; pages stay in the page cache). A tensor not aligned to its element size
    (which files written by others may have) is copied, alone. `max_tensors` as
    `read_header`'s."""
    header = read_header(path, max_tensors)
    tensors: dict[str, torch.Tensor] = {}
    if header.data_bytes == 0:
        return header, {e.name: torch.empty(e.shape, dtype=e.dtype) for e in header.entries}
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    for e in header.entries:
        offset = header.data_start + e.start
        count = e.nbytes // e.dtype.itemsize
        if count == 0:
            tensors[e.name] = torch.empty(e.shape, dtype=e.dtype)
        elif offset % e.dtype.itemsize:
            raw = torch.frombuffer(mapped, dtype=torch.uint8, count=e.nbytes, offset=offset)
            tensors[e.name] = raw.clone().view(e.dtype).reshape(e.shape)
        else:
            view = torch.frombuffer(mapped, dtype=e.dtype, count=count, offset=offset)
            tensors[e.name] = view.reshape(e.shape)
    return header, tensors


@dataclass(frozen=True)
class Spec:
    """A tensor to be written: name, dtype and shape (its bytes come later)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        numel = 1
        for d in self.shape:
            numel *= d
        return numel * self.dtype.itemsize


def file_order(specs: Sequence[Spec]) -> list[Spec]:
    """The order a file written here stores `specs` in: larger elements first (so every
    tensor starts aligned to its element size), the given order within one element size."""
    return sorted(specs, key=lambda s: -s.dtype.itemsize)


def header_bytes(specs: Sequence[Spec], metadata: Mapping[str, str] | None = None) -> bytes:
    """The 8-byte length and JSON header of a file holding `specs` in this order, padded with
    spaces so that the data starts at a multiple of 8; `InvalidArgument` for a dtype the
    format cannot name."""
    header: dict[str, object] = {"__metadata__": {"format": "pt", **(metadata or {})}}
    at = 0
    for s in specs:
        if s.name in RESERVED_TENSOR_NAMES:
            raise InvalidArgument(f"tensor {s.name!r}: a name safetensors reserves")
        if s.dtype not in NAMES:
            raise InvalidArgument(f"tensor {s.name!r}: dtype {s.dtype} has no safetensors name")
        header[s.name] = {"dtype": NAMES[s.dtype], "shape": list(s.shape),
                          "data_offsets": [at, at + s.nbytes]}  # fmt: skip
        at += s.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % _ALIGN)
    return struct.pack("<Q", len(raw)) + raw
