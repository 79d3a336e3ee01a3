"""The box a vLLM loader's view reads, and that view read out of a worker's block alone
(`ros.integrations.vllm_plan`), without vLLM: the op chains a `FakeRDTTensor` records."""

from __future__ import annotations

import pytest
import torch

from ros.integrations.vllm_plan import OpChain, view_box, view_in_block
from tensorhub.errors import InvalidArgument
from transport.boxes import Box

SHAPE = (8, 6)


def block_of(full: torch.Tensor, box: Box) -> torch.Tensor:
    return full[box.slices_in(Box((0, 0), tuple(full.shape)))].contiguous()


@pytest.mark.parametrize(
    ("ops", "box"),
    [
        ((("narrow", (0, 4, 4), ()),), Box((4, 0), (4, 6))),  # a column-parallel rank's rows
        ((("narrow", (1, 3, 3), ()),), Box((0, 3), (8, 3))),  # a row-parallel rank's columns
        ((("chunk", (2, 0), ()), ("__getitem__", (1,), ())), Box((4, 0), (4, 6))),
        ((("narrow", (0, 2, 2), ()), ("narrow", (1, 1, 4), ())), Box((2, 1), (2, 4))),
        # rows 1, 3, 5, 7: a strided walk, read out of its bounding box
        ((("view", (4, 2, 6), ()), ("narrow", (1, 1, 1), ())), Box((1, 0), (7, 6))),
        ((("flatten", (), ()), ("narrow", (0, 4, 8), ())), None),  # across rows: whole
        ((), Box((0, 0), SHAPE)),  # replicated: the whole tensor
    ],
)
def test_a_view_reads_its_box_and_is_read_out_of_the_block_alone(
    ops: OpChain, box: Box | None
) -> None:
    full = torch.arange(48, dtype=torch.float32).reshape(SHAPE)
    got, exact = view_box(SHAPE, torch.float32, ops)
    if box is None:  # a walk that wraps around rows: the whole tensor
        assert got == Box((0, 0), SHAPE)
        assert not exact
        return
    assert got == box
    assert exact
    want = full
    for op, args, kwargs in ops:
        want = getattr(want, op)(*args, **dict(kwargs))
    assert torch.equal(view_in_block(block_of(full, box), box, SHAPE, ops), want)


def test_a_view_outside_the_block_is_refused() -> None:
    full = torch.arange(48, dtype=torch.float32).reshape(SHAPE)
    mine = Box((0, 0), (4, 6))
    ops: OpChain = (("narrow", (0, 4, 4), ()),)  # the other rank's rows
    with pytest.raises(InvalidArgument, match="block is"):
        view_in_block(block_of(full, mine), mine, SHAPE, ops)
