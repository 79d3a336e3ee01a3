"""zstd contexts reused per thread: making one costs about as much as coding a small
delta chunk (15-20 us here), and a step codes hundreds of chunks. python-zstandard's
contexts are not thread-safe, so each thread keeps its own.

`decompress_exact` is the only way a delta chunk's frame is decoded: python-zstandard sizes
its output from the frame's header and ignores `max_output_size` when the header has a
content size, so a 65 KB frame that declares 2 GiB (runs of one byte) made a reader allocate
and write 2 GiB, and one that declares 1 TiB raised `MemoryError` (issue 38). The header is
read first, and a frame that does not declare exactly the size it must decode to is refused
before anything is allocated; every frame the compressor here writes declares its size.
"""

from __future__ import annotations

import threading

import zstandard

from tensorhub.errors import DeltaRefused, IntegrityError

_local = threading.local()


def compressor(level: int) -> zstandard.ZstdCompressor:
    """This thread's compressor at `level` (its frames declare their content size, which
    `decompress_exact` requires)."""
    kept: dict[int, zstandard.ZstdCompressor] | None = getattr(_local, "compressors", None)
    if kept is None:
        kept = _local.compressors = {}
    found = kept.get(level)
    if found is None:
        found = kept[level] = zstandard.ZstdCompressor(level=level, write_content_size=True)
    return found


def decompressor() -> zstandard.ZstdDecompressor:
    """This thread's decompressor."""
    found: zstandard.ZstdDecompressor | None = getattr(_local, "decompressor", None)
    if found is None:
        found = _local.decompressor = zstandard.ZstdDecompressor()
    return found


def decompress_exact(frame: bytes | memoryview, size: int, what: str = "delta chunk") -> bytes:
    """The one zstd frame `frame`, decoded to exactly `size` bytes, with nothing after it.
    `DeltaRefused` if its header declares another content size or none (nothing decoded or
    allocated: the output is at most `size` bytes whatever the frame says);
    `IntegrityError` if it is no frame or does not decode to what it declares."""
    try:
        declared = zstandard.frame_content_size(frame)
    except zstandard.ZstdError as exc:
        raise IntegrityError(f"{what} is no zstd frame: {exc}") from exc
    if declared != size:
        said = "no size" if declared < 0 else f"{declared} bytes"
        raise DeltaRefused(f"{what}: its zstd frame declares {said}, it must decode to {size}")
    try:
        raw = decompressor().decompress(frame, max_output_size=size, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise IntegrityError(f"{what} does not decode: {exc}") from exc
    if len(raw) != size:
        raise IntegrityError(f"{what} decodes to {len(raw)} bytes, not {size}")
    return raw
