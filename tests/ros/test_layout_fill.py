"""The geometry a first reader in a layout serves each chunk of its block set by
(`ros.client.slice_fill`): a flat range of a row-major array as boxes, and the elements of
a box below a flat index, checked against every element, one by one."""

from __future__ import annotations

import itertools
import math

import torch

from ros.client.slice_fill import count_below, flat_boxes
from transport.boxes import Box

SHAPES = [(), (7,), (3, 5), (4, 1, 6), (2, 3, 4), (5, 0, 2)]


def _flat(box: Box, shape: tuple[int, ...]) -> set[int]:
    """The flat indices of `box`'s elements in a row-major array of `shape`."""
    index = torch.arange(math.prod(shape)).reshape(shape)
    picked = index[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.shape, strict=True))]
    return set(picked.reshape(-1).tolist())


def test_flat_boxes_cover_exactly_the_range_and_no_element_twice() -> None:
    for shape in SHAPES:
        n = math.prod(shape)
        for lo, hi in itertools.combinations(range(n + 1), 2):
            boxes = flat_boxes(shape, lo, hi)
            got: list[int] = []
            for box in boxes:
                assert box.within(shape)
                got += sorted(_flat(box, shape))
            assert got == list(range(lo, hi)), (shape, lo, hi)  # in flat order, once each
            assert len(boxes) <= 2 * len(shape) + 1


def test_count_below_counts_a_boxs_elements_under_a_flat_index() -> None:
    for shape in SHAPES:
        ranges = [range(d + 1) for d in shape]
        for lo in itertools.product(*ranges):
            for hi in itertools.product(*ranges):
                if any(h < o for o, h in zip(lo, hi, strict=True)):
                    continue
                box = Box(lo, tuple(h - o for o, h in zip(lo, hi, strict=True)))
                flat = _flat(box, shape)
                for x in range(math.prod(shape) + 2):
                    assert count_below(box, shape, x) == sum(i < x for i in flat), (box, x)
