"""Lossless chunk deltas: one version's chunk encoded against the same chunk of its base.

An RL step changes about 1 % of a model's bf16 weights, and those it changes change in
their low bits. A chunk is encoded as `xor-adaptive-zstd1`: the XOR of the new payload with
the base payload (torch, on the tensors' own device: unchanged bytes become zeros), then one
of two forms, named by the encoding's first byte:

- **changed words** (`WORDS`, when at most an eighth of the chunk's 2-byte words changed:
  every step at lr 1e-6 in `bench delta`): the positions of the words that
  changed and their XOR, gap-coded, in byte planes, zstd level 1 (`transport.delta_words`).
  Applying it touches only those words;
- **byte planes** (`PLANES`, denser changes): the XOR in planes of 2-byte words (all first
  bytes, then all second bytes: the zeros of the high bytes of a bf16 word line up in one
  long run), zstd level 1. Applying it decodes and XORs every byte of the chunk.

Applying reverses the steps and XORs the result into the base bytes in place. A chunk whose
encoding is over `WHOLE_RATIO` of its payload is not encoded: it is sent whole. The first
encoding, `xor-shuffle-zstd1` (every chunk byte planes, no kind byte), is still applied
when a manifest names it. The alternatives measured (positions plus values, XOR with zlib
or lz4, no planes, the two forms) and why these won are in docs/design-notes.md, "Delta
versions".

Chunks are lists of flat uint8 tensors (a chunk's segments, `HeldVersion.chunk_parts`):
the padding between tensors is never read, written or sent.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Sequence

import numpy as np
import torch
import xxhash

from tensorhub.delta_rules import ENCODING, ENCODINGS, PLANES, WHOLE_RATIO
from tensorhub.errors import IntegrityError
from transport import delta_words, zstd_contexts
from transport.checksums import WSUM64, wsum64_of_segments
from transport.store import HeldVersion

__all__ = ["ENCODING", "ENCODINGS", "PLANES", "WHOLE_RATIO", "apply", "apply_words",
           "chunk_checksum", "decode_words", "digest", "encode", "payload"]  # fmt: skip

LEVEL = 1  # zstd level: 0.05-0.15 s per 53 MiB here, within 10 % of level 3's size
WORDS, DENSE = b"\x01", b"\x00"  # an `xor-adaptive-zstd1` chunk's first byte: its form


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


def encode(
    base: Sequence[torch.Tensor], new: Sequence[torch.Tensor], *, advance: bool = False
) -> bytes | None:
    """The `ENCODING` of chunk `new` against chunk `base` (each a chunk's segments, the same
    lengths), or None when it would be over `WHOLE_RATIO` of the payload. It runs on `new`'s
    device: a base on another (a host copy of a GPU version) is copied there first, one
    chunk at a time. `advance`: afterwards `base` holds `new`'s bytes, written where `base`
    is (only the changed words, when they are few): a publisher's copy of what it
    published, brought to the next version while both chunks are in the cache."""
    old, now = payload(base), payload(new)
    if old.device != now.device:  # a base copy kept on the host, a version on a GPU
        old = old.to(now.device)
    if old.numel() != now.numel():
        raise IntegrityError(f"delta of chunks of {old.numel()} and {now.numel()} bytes")
    if now.numel() == 0:
        return None
    words = delta_words.changed(old, now) if now.numel() % 2 == 0 else None
    if words is not None:
        idx, values = words
        encoded = WORDS + delta_words.encode(now.numel() // 2, idx, values, level=LEVEL)
        if advance:
            delta_words.apply(base, idx, values.view(np.uint16).reshape(-1))
    else:
        encoded = DENSE + _planes(torch.bitwise_xor(old, now))
        if advance:
            delta_words.copy_into(base, now)
    if len(encoded) > WHOLE_RATIO * now.numel():
        return None
    return encoded


def _planes(x: torch.Tensor) -> bytes:
    """The zstd frame of the byte planes of the XOR `x` (the one copy that leaves a GPU)."""
    planes = _shuffle(x)
    host = planes.cpu() if planes.device.type != "cpu" else planes
    return zstd_contexts.compressor(LEVEL).compress(host.numpy().data)


def apply(
    dest: Sequence[torch.Tensor], encoded: bytes | memoryview, encoding: str = ENCODING
) -> None:
    """XOR the decoded chunk into `dest` (the base chunk's segments) in place: afterwards
    `dest` holds the new chunk. `encoding` is the manifest's. `IntegrityError` if `encoded`
    is not an encoding of a chunk of exactly this size (nothing written then); its
    `DeltaRefused` for a zstd frame that declares another size than its form must decode
    to, or none, found before anything is decoded: whatever a frame says, applying it
    allocates no more than the chunk's size (and a changed-words frame at most 3/4 of it;
    `zstd_contexts.decompress_exact`)."""
    if encoding not in ENCODINGS:
        raise IntegrityError(f"unknown delta encoding {encoding!r}")
    view = memoryview(encoded)
    if encoding == PLANES:
        _apply_planes(dest, view)
        return
    size = sum(int(part.numel()) for part in dest)
    form, body = bytes(view[:1]), view[1:]
    if form == DENSE:
        _apply_planes(dest, body)
    elif form == WORDS and size % 2 == 0:
        delta_words.apply(dest, *delta_words.decode(body, size // 2))
    else:
        raise IntegrityError(f"delta chunk of form {form!r} for a chunk of {size} bytes")


def decode_words(
    encoded: Sequence[bytes | memoryview], sizes: Sequence[int]
) -> list[delta_words.Decoded | IntegrityError]:
    """For chunks of `sizes[k]` bytes, each encoding's changed words (positions and XOR
    words, `delta_words.decode`), decoded together (`delta_words.decode_many`: what a
    reader applying hundreds of chunks does); for one that is not of `ENCODING`'s
    changed-words form for a chunk of its size, or that `apply` refuses, its
    `IntegrityError` (`DeltaRefused`), found by the same checks before anything is
    decoded or written. Apply the rest with `apply_words`."""
    refused: dict[int, IntegrityError] = {}  # by position in `encoded`
    bodies: list[memoryview] = []
    words: list[int] = []
    for k, (blob, size) in enumerate(zip(encoded, sizes, strict=True)):
        view = memoryview(blob)
        if size % 2 or bytes(view[:1]) != WORDS:
            refused[k] = IntegrityError(
                f"delta chunk of form {bytes(view[:1])!r}: not changed words"
            )
            continue
        bodies.append(view[1:])
        words.append(size // 2)
    read = iter(delta_words.decode_many(bodies, words))  # one for each body, in order
    return [refused[k] if k in refused else next(read) for k in range(len(encoded))]


def apply_words(dest: Sequence[memoryview], decoded: delta_words.Decoded) -> None:
    """XOR a chunk's changed words (`decode_words`) into `dest`, the chunk in host memory
    as its segments' writable byte views, each of whole words (`HeldVersion.source_views`),
    in place; applied again, the chunk is back as it was."""
    delta_words.xor_host(dest, *decoded)


def _apply_planes(dest: Sequence[torch.Tensor], encoded: memoryview) -> None:
    """Apply the zstd frame of the XOR's byte planes (`_planes`) to `dest`."""
    size = sum(int(part.numel()) for part in dest)
    raw = zstd_contexts.decompress_exact(encoded, size)  # the header's size is checked first
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


def chunk_checksum(held: HeldVersion, index: int, kind: str) -> int:
    """The checksum (of `kind`, as a manifest's) of the bytes chunk `index` of `held` holds
    now, whatever it has cached: how a reader checks that its memory is exactly the base,
    and the result of applying. Host memory is hashed through `held`'s views of it (no
    tensor per segment: a reader does this twice a chunk)."""
    if kind == WSUM64:
        return wsum64_of_segments(held.flats, held.segments(index))
    if not held.on_cuda:
        views = held.source_views(index)
        if len(views) == 1:  # one call, no hasher object: a reader does this for each chunk
            return int(xxhash.xxh3_64_intdigest(views[0]))
    h = xxhash.xxh3_64()
    if held.on_cuda:
        for part in held.chunk_parts(index):
            h.update(part.cpu().numpy().data)
    else:
        for view in views:
            h.update(view)
    return int(h.intdigest())
