"""Which copies move a batch of chunks: the chunks' segments, joined where they touch.

A chunk is 4 MiB by default, and one `copy_` per chunk from Python is bound by launch
overhead, not by the GPU's copy rate. A batch of consecutive chunks over the same tensor is
one contiguous range of that tensor, so it becomes one copy; a chunk that packs many small
tensors becomes one copy per tensor. Device-agnostic (plain arithmetic over the layout).
"""

from __future__ import annotations

from collections.abc import Iterable

from transport.layout import Layout

Span = tuple[int, int, int]
"""(tensor index in the layout, first byte in that tensor, length)."""


def coalesce(layout: Layout, chunks: Iterable[int]) -> list[Span]:
    """The fewest spans covering the segments of `chunks` (duplicates and order ignored)."""
    spans: list[Span] = []
    for index in sorted(set(chunks)):
        for seg in layout.segments(index):
            if spans:
                tensor, start, length = spans[-1]
                if tensor == seg.tensor and start + length == seg.start:
                    spans[-1] = (tensor, start, length + seg.length)
                    continue
            spans.append((seg.tensor, seg.start, seg.length))
    return spans
