"""Hand-made zstd frames for hostile-delta tests (issue 38): a frame is a header and blocks
(RFC 8878), so one that declares any content size, or none, and holds runs of one byte
(RLE blocks, 4 bytes per 128 KiB) is a few bytes of Python, made in microseconds."""

from __future__ import annotations

import struct

MAGIC = 0xFD2FB528
BLOCK = 128 << 10  # the largest block


def frame(declared: int | None, content: int | None = None, *, byte: int = 0) -> bytes:
    """A frame whose header declares `declared` bytes (None: no content size), holding
    `content` bytes (default: `declared`) of `byte` in RLE blocks. A frame that declares a
    size is single-segment (its window is its content: no window descriptor)."""
    content = (declared or 0) if content is None else content
    if declared is None:  # no size, and a window descriptor (128 KiB)
        head = bytes([0x00, (17 - 10) << 3])
    elif declared < 1 << 32:
        head = bytes([(2 << 6) | 0x20]) + struct.pack("<I", declared)
    else:
        head = bytes([(3 << 6) | 0x20]) + struct.pack("<Q", declared)
    out = bytearray(struct.pack("<I", MAGIC) + head)
    left = content
    while True:
        n = min(BLOCK, left)
        left -= n
        last = int(left == 0)
        out += (last | (1 << 1) | (n << 3)).to_bytes(3, "little") + bytes([byte])
        if last:
            return bytes(out)


def windowed(size: int, window_log: int) -> bytes:
    """A frame that declares `size` (right) but a window of 2**`window_log` bytes (not
    single-segment), holding `size` zero bytes."""
    head = bytes([2 << 6, (window_log - 10) << 3]) + struct.pack("<I", size)
    out = bytearray(struct.pack("<I", MAGIC) + head)
    left = size
    while True:
        n = min(BLOCK, left)
        left -= n
        last = int(left == 0)
        out += (last | (1 << 1) | (n << 3)).to_bytes(3, "little") + b"\0"
        if last:
            return bytes(out)


def words_head(words: int, count: int) -> bytes:
    """The changed-words form's header after its kind byte: the chunk's words, the count."""
    return words.to_bytes(4, "little") + count.to_bytes(4, "little")
