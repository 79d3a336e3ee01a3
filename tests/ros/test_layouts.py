"""Readers in another layout hold their blocks and serve each other (docs/design-notes.md,
"Readers in another layout"): through the SDK, against a real hub, etcd and holder
processes; every reader ends on the publisher's bytes."""

from __future__ import annotations

from collections.abc import Callable

import torch

import ros
from tests.ros.layout_model import block_bytes, expected, publish_tp, slices_for


def _same(got: dict[str, torch.Tensor], rank: int, ranks: int) -> None:
    for name, want in expected(rank, ranks).items():
        assert torch.equal(got[name], want), name


def test_second_reader_of_a_layout_reads_every_byte_from_the_first(
    connect: Callable[..., ros.Hub],
) -> None:
    trainers = publish_tp(connect, 2)
    first, second = connect(), connect()
    out1, slices1 = slices_for(0, 2)
    got1 = first.fetch_slices("policy", 1, slices=slices1, layout="tp2", timeout=30)
    _same(out1, 0, 2)
    assert got1.served
    assert set(got1.bytes_per_source) <= {t.holder_name for t in trainers}
    assert got1.from_trainer == set(slices1)
    out2, slices2 = slices_for(0, 2)
    got2 = second.fetch_slices("policy", 1, slices=slices2, layout="tp2", timeout=30)
    _same(out2, 0, 2)
    assert got2.bytes_per_source == {first.holder_name: block_bytes(0, 2)}
    assert got2.from_trainer == set()
    assert got2.served
