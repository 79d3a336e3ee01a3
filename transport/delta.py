"""Lossless chunk deltas: one version's chunk encoded against the same chunk of its base.

An RL step changes about 1 % of a model's bf16 weights, and those it changes change in
their low bits. A chunk is encoded as `xor-shuffle-zstd1`:

1. XOR the new payload with the base payload (torch, on the tensors' own device): unchanged
   bytes become zeros;
2. byte-shuffle the XOR in 2-byte words (all first bytes, then all second bytes; torch, on
   the device): the zeros of the high bytes of a bf16 word line up in one long run;
3. compress with zstd at level 1 (on the host: the one copy that leaves a GPU is the XOR).

Applying reverses the steps and XORs the result into the base bytes in place. A chunk whose
encoding is over `WHOLE_RATIO` of its payload is not encoded: it is sent whole. The
alternatives measured (positions plus values, XOR with zlib or lz4, no shuffle) and why
this one won are in docs/design-notes.md, "Delta versions".

Chunks are lists of flat uint8 tensors (a chunk's segments, `HeldVersion.chunk_parts`):
the padding between tensors is never read, written or sent.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Sequence

import torch
import xxhash
import zstandard

from tensorhub.delta_rules import ENCODING, ENCODINGS, WHOLE_RATIO
from tensorhub.errors import IntegrityError
from transport.checksums import WSUM64, wsum64_of_segments
from transport.layout import Segment

__all__ = ["ENCODING", "ENCODINGS", "WHOLE_RATIO", "apply", "chunk_checksum", "digest",
           "encode", "payload"]  # fmt: skip

LEVEL = 1  # zstd level: 0.05-0.15 s per 53 MiB here, within 10 % of level 3's size


def payload(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """A chunk's payload as one flat uint8 tensor on its device (a copy only when it has more
    than one segment)."""
    if len(parts) == 1:
        return parts[0]
    if not parts:
        return torch.empty(0, dtype=torch.uint8)
    return torch.cat(list(parts))


_LITTLE = sys.byteorder == "little"  # a 2-byte word's first byte is its low byte


def _shuffle(x: torch.Tensor) -> torch.Tensor:
    """Byte planes of 2-byte words: [a0 b0 a1 b1 ...] -> [a0 a1 ... b0 b1 ...]. As the
    low and high bytes of int16 words: two elementwise casts, about 20x faster than the
    transposing copy of a uint8 view (which it equals; that copy is the fallback)."""
    if x.numel() % 2:
        return x
    if not _LITTLE:
        return x.view(-1, 2).t().contiguous().view(-1)
    words = x.view(torch.int16)
    return torch.cat([words.to(torch.uint8), (words >> 8).to(torch.uint8)])


def _unshuffle(x: torch.Tensor) -> torch.Tensor:
    """The inverse of `_shuffle`: each word is its low plane's byte OR its high plane's
    byte shifted up (int16 arithmetic wraps to the same bits)."""
    if x.numel() % 2:
        return x
    if not _LITTLE:
        return x.view(2, -1).t().contiguous().view(-1)
    half = x.numel() // 2
    words = x[:half].to(torch.int16) | (x[half:].to(torch.int16) << 8)
    return words.view(torch.uint8)


def encode(base: Sequence[torch.Tensor], new: Sequence[torch.Tensor]) -> bytes | None:
    """The encoding of chunk `new` against chunk `base` (each a chunk's segments, the same
    lengths), or None when it would be over `WHOLE_RATIO` of the payload. It runs on `new`'s
    device: a base on another (a host copy of a GPU version) is copied there first, one
    chunk at a time."""
    old, now = payload(base), payload(new)
    if old.device != now.device:  # a base copy kept on the host, a version on a GPU
        old = old.to(now.device)
    if old.numel() != now.numel():
        raise IntegrityError(f"delta of chunks of {old.numel()} and {now.numel()} bytes")
    if now.numel() == 0:
        return None
    x = _shuffle(torch.bitwise_xor(old, now))
    host = x.cpu() if x.device.type != "cpu" else x
    encoded = zstandard.ZstdCompressor(level=LEVEL).compress(host.numpy().data)
    if len(encoded) > WHOLE_RATIO * now.numel():
        return None
    return encoded


def apply(dest: Sequence[torch.Tensor], encoded: bytes | memoryview) -> None:
    """XOR the decoded chunk into `dest` (the base chunk's segments) in place: afterwards
    `dest` holds the new chunk. `IntegrityError` if `encoded` is not a frame of exactly the
    chunk's size (nothing written then)."""
    size = sum(int(part.numel()) for part in dest)
    try:
        raw = zstandard.ZstdDecompressor().decompress(bytes(encoded), max_output_size=size)
    except zstandard.ZstdError as exc:
        raise IntegrityError(f"delta chunk does not decode: {exc}") from exc
    if len(raw) != size:
        raise IntegrityError(f"delta chunk decodes to {len(raw)} bytes, the chunk has {size}")
    device = dest[0].device if dest else torch.device("cpu")
    with warnings.catch_warnings():  # read only: torch warns of a buffer it cannot write
        warnings.simplefilter("ignore", UserWarning)
        decoded = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0)
    x = _unshuffle(decoded.to(device))
    at = 0
    for part in dest:
        n = int(part.numel())
        part.bitwise_xor_(x[at : at + n])
        at += n


def digest(encoded: bytes | memoryview) -> int:
    """xxh3-64 of an encoded chunk: what the manifest records and a reader checks."""
    return int(xxhash.xxh3_64_intdigest(encoded))


def chunk_checksum(flats: Sequence[torch.Tensor], segments: Sequence[Segment], kind: str) -> int:
    """The checksum (of `kind`, as a manifest's) of the bytes a chunk's memory holds now,
    whatever a store has cached: how a reader checks that its memory is exactly the base."""
    if kind == WSUM64:
        return wsum64_of_segments(flats, segments)
    h = xxhash.xxh3_64()
    for s in segments:
        part = flats[s.tensor][s.start : s.start + s.length]
        h.update((part.cpu() if part.device.type != "cpu" else part).numpy().data)
    return int(h.intdigest())
