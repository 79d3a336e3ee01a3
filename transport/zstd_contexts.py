"""zstd contexts reused per thread: making one costs about as much as coding a small
delta chunk (15-20 us here), and a step codes hundreds of chunks. python-zstandard's
contexts are not thread-safe, so each thread keeps its own."""

from __future__ import annotations

import threading

import zstandard

_local = threading.local()


def compressor(level: int) -> zstandard.ZstdCompressor:
    """This thread's compressor at `level`."""
    kept: dict[int, zstandard.ZstdCompressor] | None = getattr(_local, "compressors", None)
    if kept is None:
        kept = _local.compressors = {}
    found = kept.get(level)
    if found is None:
        found = kept[level] = zstandard.ZstdCompressor(level=level)
    return found


def decompressor() -> zstandard.ZstdDecompressor:
    """This thread's decompressor."""
    found: zstandard.ZstdDecompressor | None = getattr(_local, "decompressor", None)
    if found is None:
        found = _local.decompressor = zstandard.ZstdDecompressor()
    return found
