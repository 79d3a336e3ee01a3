"""Box math for reading across layouts, checked against torch indexing (Hypothesis)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from transport.boxes import Box, byte_span, chunks_for
from transport.layout import Layout


@st.composite
def box_pairs(draw: st.DrawFn) -> tuple[tuple[int, ...], Box, Box]:
    """A global shape and two boxes inside it."""
    rank = draw(st.integers(0, 3))
    shape = tuple(draw(st.integers(1, 6)) for _ in range(rank))

    def box() -> Box:
        offsets = tuple(draw(st.integers(0, n - 1)) for n in shape)
        extent = tuple(draw(st.integers(1, n - o)) for n, o in zip(shape, offsets, strict=True))
        return Box(offsets, extent)

    return shape, box(), box()


@settings(max_examples=300, deadline=None)
@given(box_pairs())
def test_intersection_and_slices_match_torch_indexing(
    case: tuple[tuple[int, ...], Box, Box],
) -> None:
    shape, a, b = case
    full = torch.arange(max(1, torch.Size(shape).numel())).reshape(shape)
    held = full[a.slices_in(Box((0,) * len(shape), shape))].contiguous()
    want = full[b.slices_in(Box((0,) * len(shape), shape))]
    common = a.intersect(b)
    mask = torch.zeros(shape, dtype=torch.bool)
    mask[a.slices_in(Box((0,) * len(shape), shape))] = True
    other = torch.zeros(shape, dtype=torch.bool)
    other[b.slices_in(Box((0,) * len(shape), shape))] = True
    if common is None:
        assert not (mask & other).any()
        return
    assert common.volume == int((mask & other).sum())
    piece = held[common.slices_in(a)]  # taken from the holder of `a` ...
    assert torch.equal(piece, want[common.slices_in(b)])  # ... lands where `b` wants it
    # every element of the intersection lies in the contiguous byte span
    first, end = byte_span(a, common, held.element_size())
    flat = held.reshape(-1)
    inside = flat[first // held.element_size() : end // held.element_size()]
    assert set(piece.reshape(-1).tolist()) <= set(inside.tolist())


def test_chunks_for_a_span_cover_exactly_the_overlapping_chunks() -> None:
    tensors = {
        "a": torch.zeros(100, dtype=torch.uint8),
        "b": torch.zeros(10_000, dtype=torch.uint8),
    }
    layout = Layout.from_tensors(tensors, 4096)
    b = layout.tensors[1]
    span = chunks_for(layout, b, 0, 10_000)
    assert span == range(b.offset // 4096, (b.offset + 10_000 - 1) // 4096 + 1)
    assert chunks_for(layout, b, 5000, 5001) == range(
        (b.offset + 5000) // 4096, (b.offset + 5000) // 4096 + 1
    )
    assert chunks_for(layout, b, 7, 7) == range(0)
