"""The publisher's per-chunk checksums: which algorithm a manifest names, and `wsum64`, the
one a GPU computes with torch operations where the tensors are.

A manifest's `checksum` field names the algorithm of its `chunk_xxh3` values (the field's
name is historical): `xxh3-64` (the default, also when the field is empty: every manifest
written before the field) or `wsum64`. Readers verify either; versions of both kinds coexist.

`xxh3-64` needs the bytes on the CPU: for tensors in GPU memory the publisher would copy the
whole model to the host at every step just to checksum it. `wsum64` is a weighted sum that
torch computes on any device, as two elementwise kernels and a reduction:

    pad the chunk's bytes with zeros to a multiple of 8; read them as little-endian 64-bit
    words w_0 .. w_{n-1}; with the fixed odd multipliers m_j = splitmix64(j) | 1,
        wsum64 = (sum over j of w_j * m_j) mod 2**64

The multipliers are computed once per chunk length (with numpy, on the CPU) and kept on the
device; int64 multiplication and summation wrap modulo 2**64 in two's complement on CPU and
CUDA alike, so the GPU's value equals the CPU's, which a reader computes over what it
received (`wsum64_of_views`) and `wsum64_reference` computes in plain numpy uint64.

Error detection (docs/transport.md, "Publisher checksums"): every change confined to one
64-bit word is detected (each m_j is odd, so invertible modulo 2**64); for any other fixed
change e (a vector of word differences), the sum misses it only if sum(e_j * m_j) = 0 mod
2**64, which for pseudo-random odd multipliers happens with probability about 2**-(63 - t)
when every e_j is divisible by 2**t (about 2**-63 for ordinary corruption: a flipped bit, a
torn or stale region, zeroed pages, swapped words). Like xxh3 it is not cryptographic: it
guards against corruption and broken mutability contracts, not against a holder that
computes a collision on purpose (read tokens and tenants are the defence there).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import torch

from tensorhub.checksum_kinds import KINDS, WSUM64, XXH3
from tensorhub.errors import InvalidArgument, InvalidManifest
from transport.layout import Segment

__all__ = [
    "KINDS",
    "WSUM64",
    "XXH3",
    "kind_of",
    "wsum64",
    "wsum64_of_rows",
    "wsum64_of_segments",
    "wsum64_of_views",
    "wsum64_reference",
]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_lock = threading.Lock()
_multipliers: dict[tuple[int, str], torch.Tensor] = {}


def kind_of(name: str) -> str:
    """The algorithm a manifest's `checksum` field names ("" is `xxh3-64`); an unknown
    name is `InvalidManifest` (a reader must not skip a check it cannot run)."""
    kind = name or XXH3
    if kind not in KINDS:
        raise InvalidManifest(f"unknown chunk checksum {name!r}: this reader knows {KINDS}")
    return kind


def _splitmix64(index: np.ndarray) -> np.ndarray:
    """splitmix64 of each index (numpy uint64 arithmetic wraps modulo 2**64)."""
    with np.errstate(over="ignore"):
        z = index.astype(np.uint64) * _GOLDEN + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def multipliers_np(words: int) -> np.ndarray:
    """The first `words` multipliers, as numpy uint64 (the formula's definition)."""
    return _splitmix64(np.arange(words, dtype=np.uint64)) | np.uint64(1)


def multipliers(words: int, device: torch.device) -> torch.Tensor:
    """The first `words` multipliers as an int64 tensor on `device`, cached per length and
    device (one chunk size per version: a handful of tensors per process)."""
    key = (words, str(device))
    with _lock:
        cached = _multipliers.get(key)
    if cached is None:
        host = torch.from_numpy(multipliers_np(words).view(np.int64).copy())
        cached = host.to(device)
        with _lock:
            _multipliers[key] = cached
    return cached


def wsum64(data: torch.Tensor) -> int:
    """wsum64 of a 1-D uint8 tensor on any device (the chunk's bytes, in order). The work is
    done where the tensor is; only the 8-byte result crosses to the host."""
    if data.dtype != torch.uint8 or data.dim() != 1:
        raise InvalidArgument("wsum64 takes a 1-D uint8 tensor")
    pad = -data.numel() % 8
    if pad:
        data = torch.cat([data, torch.zeros(pad, dtype=torch.uint8, device=data.device)])
    if not data.numel():
        return 0
    if not data.is_contiguous() or data.storage_offset() % 8:
        data = data.clone()  # int64 views need 8-byte alignment
    words = data.view(torch.int64)
    total = torch.sum(words * multipliers(words.numel(), data.device))
    return int(total.item()) & 0xFFFF_FFFF_FFFF_FFFF


def wsum64_of_rows(buf: torch.Tensor, chunk_size: int) -> list[int]:
    """wsum64 of each `chunk_size` bytes of the 1-D uint8 tensor `buf` (whole chunks, on any
    device; `chunk_size` a multiple of 8), in one multiply and one reduction. `buf` is
    overwritten: the caller's scratch buffer, read no more."""
    words = chunk_size // 8
    rows = buf.view(torch.int64).view(-1, words)
    rows.mul_(multipliers(words, buf.device))  # in place: no second buffer of the group
    return [int(x) & 0xFFFF_FFFF_FFFF_FFFF for x in rows.sum(dim=1).tolist()]


def wsum64_of_segments(flats: Sequence[torch.Tensor], segments: Sequence[Segment]) -> int:
    """wsum64 of one chunk given as `segments` of the uint8 tensors `flats` (one per layout
    tensor), computed where they are: one kernel pass when the chunk is one segment, else
    over the segments joined (a chunk that packs small tensors is small itself)."""
    parts = [flats[s.tensor][s.start : s.start + s.length] for s in segments]
    if not parts:
        return 0
    return wsum64(parts[0] if len(parts) == 1 else torch.cat(parts))


def wsum64_of_views(views: Sequence[memoryview]) -> int:
    """wsum64 of the bytes of `views` back to back (host memory: what a reader received)."""
    if len(views) == 1 and not views[0].readonly:  # the received chunk itself: no copy
        buffer: memoryview | bytearray = views[0]
    else:
        buffer = bytearray(b"".join(views))
    if len(buffer) == 0:
        return 0
    return wsum64(torch.frombuffer(buffer, dtype=torch.uint8))


def wsum64_reference(data: bytes) -> int:
    """wsum64 in plain numpy uint64 arithmetic: the definition the torch kernels must match."""
    padded = data + b"\0" * (-len(data) % 8)
    words = np.frombuffer(padded, dtype="<u8")
    with np.errstate(over="ignore"):
        return int(np.sum(words * multipliers_np(len(words)), dtype=np.uint64))
