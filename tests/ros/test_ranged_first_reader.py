"""The first reader of a block set of a declared layout reads only its blocks' bytes of the
trainer's chunks (GET_RANGES), checks each chunk of its block set against the publisher's
wsum64, and reads whole chunks where that fails (docs/design-notes.md, "Readers in another
layout"). Real hub, etcd and sockets (tests/ros/conftest.py)."""

from __future__ import annotations

import functools
import itertools
import math
import socket
from collections.abc import Callable
from dataclasses import dataclass, replace

import pytest
import torch
import xxhash

import ros
from chaos.holder_faults import Fault
from ros.client.hooks import ClientHooks
from ros.client.slice_plan import Copy
from ros.client.slice_ranges import box_runs, needed_ranges
from tests.ros.layout_model import CHUNK, block_bytes, expected, global_model, slices_for
from transport.boxes import Box
from transport.layout import Layout
from transport.server import send_chunk
from transport.wire import ChunkHeader

TENANT = "rl"
WHOLE = Layout.from_tensors(global_model(), chunk_size=CHUNK)  # the trainer's chunks


@pytest.fixture
def clients(connect: Callable[..., ros.Hub]) -> Callable[..., ros.Hub]:
    return functools.partial(connect, TENANT)


@dataclass
class RangeLiar(Fault):
    """A trainer's sender that changes a byte of every byte range it sends (a CHUNK frame
    that is not a whole chunk), whole chunks intact. `matching`: with the xxh3-64 of the
    changed bytes in the frame (only the publisher's sums can tell), else the true one's."""

    matching: bool = True

    def __call__(
        self, conn: socket.socket, header: ChunkHeader, views: list[memoryview], complete: bool
    ) -> None:
        if header.length != WHOLE.payload_bytes(header.index):
            data = bytearray(b"".join(views))
            data[len(data) // 2] ^= 0xFF
            views = [memoryview(data)]
            if self.matching:
                header = replace(header, checksum=xxhash.xxh3_64_intdigest(bytes(data)))
        send_chunk(conn, header, views, complete)


def _publish(clients: Callable[..., ros.Hub], declare: str | None, **kw: object) -> ros.Hub:
    """A trainer's policy@1 and @2, the layout `declare` declared (TP-2) between them."""
    trainer = clients(**kw)
    trainer.publish("policy", 1, global_model(), chunk_size=CHUNK)
    if declare is not None:
        clients().declare_layout("policy", declare, [slices_for(r, 2)[1] for r in range(2)])
    trainer.publish("policy", 2, global_model(), chunk_size=CHUNK)
    return trainer


def _same(out: dict[str, torch.Tensor], rank: int) -> None:
    for name, want in expected(rank, 2).items():
        assert torch.equal(out[name], want), name


def test_a_first_reader_of_a_declared_layout_reads_exactly_its_blocks_bytes(
    clients: Callable[..., ros.Hub],
) -> None:
    trainer = _publish(clients, "tp2")
    out, slices = slices_for(1, 2)  # o.weight split on dim 1: every chunk of it half needed
    got = clients().fetch_slices("policy", 2, slices=slices, layout="tp2", timeout=30)
    assert got.bytes_per_source == {trainer.holder_name: block_bytes(1, 2)}
    assert got.range_failures == []
    assert got.served
    _same(out, 1)
    # the control: a layout not declared reads the same blocks' trainer chunks whole
    out_u, slices_u = slices_for(1, 2)
    whole = clients().fetch_slices("policy", 2, slices=slices_u, layout="tp2u", timeout=30)
    assert whole.total_bytes > got.total_bytes
    assert whole.range_failures == []
    _same(out_u, 1)


@pytest.mark.parametrize("matching", [True, False])
def test_range_bytes_a_trainer_corrupts_end_on_the_publishers_bytes_via_whole_chunks(
    clients: Callable[..., ros.Hub], matching: bool
) -> None:
    """With matching frames only the publisher's wsum64 of the block set's chunks tells: the
    blocks of each failing chunk are read again in whole chunks. With frames that do not
    match, the range read fails on the way and the step reads whole chunks at once."""
    trainer = _publish(clients, "tp2", hooks=ClientHooks(send=RangeLiar(matching=matching)))
    out, slices = slices_for(1, 2)
    got = clients().fetch_slices("policy", 2, slices=slices, layout="tp2", timeout=30)
    _same(out, 1)
    assert got.served
    assert got.range_failures
    why = "differs from the publisher's" if matching else "failed its checksum"
    assert any(why in failure for failure in got.range_failures), got.range_failures
    assert set(got.bytes_per_source) == {trainer.holder_name}
    # a second reader of the block set reads the first's verified bytes
    out2, slices2 = slices_for(1, 2)
    again = clients().fetch_slices("policy", 2, slices=slices2, layout="tp2", timeout=30)
    assert trainer.holder_name not in again.bytes_per_source
    _same(out2, 1)


@pytest.mark.parametrize(
    ("shape", "box"),
    [
        ((6, 5, 4), Box((1, 2, 0), (3, 2, 4))),
        ((6, 5, 4), Box((0, 0, 1), (6, 5, 2))),
        ((8, 4), Box((2, 0), (3, 4))),
        ((7,), Box((3,), (2,))),
        ((), Box((), ())),
    ],
)
def test_a_boxs_runs_are_its_elements_in_flat_order(shape: tuple[int, ...], box: Box) -> None:
    flat = torch.arange(math.prod(shape)).reshape(shape)
    want = flat[box.slices_in(Box((0,) * len(shape), shape))].flatten().tolist()
    got = [i for first, n in box_runs(shape, box) for i in range(first, first + n)]
    assert got == want


def test_needed_ranges_are_exactly_the_bytes_a_workers_copies_take() -> None:
    """Of the trainer's whole-model layout, the ranges TP-2 rank 1's blocks take: as many
    bytes as its blocks, each byte in the chunks it belongs to, none twice."""
    layout = WHOLE
    specs = {s.name: s for s in layout.tensors}
    _, slices = slices_for(1, 2)
    copies = [
        Copy(name, Box((0,) * len(spec.shape), spec.shape), slices[name].box)
        for name, spec in specs.items()
    ]
    ranges = needed_ranges(copies, layout, specs, set(range(layout.num_chunks)))
    assert sum(r.length for r in ranges) == block_bytes(1, 2)
    assert all(r.offset + r.length <= layout.payload_bytes(r.chunk) for r in ranges)
    for a, b in itertools.pairwise(ranges):
        assert (a.chunk, a.offset + a.length) < (b.chunk, b.offset)  # sorted, apart, merged
