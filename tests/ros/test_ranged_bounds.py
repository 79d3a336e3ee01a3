"""A first reader of a declared layout whose blocks take a few bytes of every row asks the
trainer for a bounded number of byte ranges of each chunk (`slice_ranges.bounded`: ranges
fewer than `GAP` bytes apart merged, a chunk of too many ranges read whole as one), and
still ends on the publisher's bytes; a second reader of the block set reads them from the
first. Real hub, etcd and sockets (tests/ros/conftest.py)."""

from __future__ import annotations

import functools
import itertools
import socket
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch

import ros
from ros.client.hooks import ClientHooks, RangeReader
from ros.client.slice_plan import Copy
from ros.client.slice_ranges import GAP, bounded, max_ranges, needed_ranges
from transport.boxes import Box
from transport.layout import Layout
from transport.server import send_chunk
from transport.wire import ChunkHeader, ChunkRange

TENANT = "rl"
CHUNK = 4096
ROWS = 256


class FrameCounter:
    """A trainer's sender that counts the CHUNK frames it sends of each (version, chunk)."""

    def __init__(self) -> None:
        self.frames: Counter[tuple[int, int]] = Counter()
        self._lock = threading.Lock()

    def __call__(
        self, conn: socket.socket, header: ChunkHeader, views: list[memoryview], complete: bool
    ) -> None:
        with self._lock:
            self.frames[(header.version, header.index)] += 1
        send_chunk(conn, header, views, complete)


def _model(cols: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(cols)
    return {"w": torch.randn(ROWS, cols, generator=g)}


def _slices(cols: int, take: int, rank: int) -> tuple[torch.Tensor, dict[str, ros.Slice]]:
    """Rank 1 takes the last `take` columns of every row, rank 0 the others."""
    lo, n = (0, cols - take) if rank == 0 else (cols - take, take)
    out = torch.empty(ROWS, n)
    return out, {"w": ros.Slice(out, (0, lo), (ROWS, cols))}


def _at(r: ChunkRange) -> tuple[int, int]:
    return r.chunk, r.offset


def _needed(cols: int, take: int) -> list[ChunkRange]:
    layout = Layout.from_tensors(_model(cols), chunk_size=CHUNK)
    spec = layout.tensors[0]
    copy = Copy("w", Box((0, 0), spec.shape), Box((0, cols - take), (ROWS, take)))
    return needed_ranges([copy], layout, {"w": spec}, set(range(layout.num_chunks)))


@pytest.mark.parametrize(
    ("cols", "take", "whole"),
    [
        (16, 1, True),  # 4 B of each 64 B row: 60 B gaps merge, the chunk's one range ~all of it
        (32, 1, True),  # 4 B of each 128 B row: 32 ranges a chunk, more than max_ranges
        (64, 2, False),  # 8 B of each 256 B row: 16 ranges a chunk, 248 B apart, asked as such
    ],
)
def test_tiny_ranges_are_asked_in_bounded_numbers_and_end_on_the_publishers_bytes(
    connect: Callable[..., ros.Hub], cols: int, take: int, whole: bool
) -> None:
    clients = functools.partial(connect, TENANT)
    counter = FrameCounter()
    asked: list[ChunkRange] = []

    def recording(inner: RangeReader) -> RangeReader:
        def read(source: Any, dest: Any, ranges: Any, **kw: Any) -> int:
            asked.extend(ranges)
            return inner(source, dest, ranges, **kw)

        return read

    trainer = clients(hooks=ClientHooks(send=counter))
    trainer.publish("policy", 1, _model(cols), chunk_size=CHUNK)
    clients().declare_layout("policy", "cols", [_slices(cols, take, r)[1] for r in range(2)])
    trainer.publish("policy", 2, _model(cols), chunk_size=CHUNK)

    out, slices = _slices(cols, take, 1)
    got = clients(hooks=ClientHooks(ranges=recording)).fetch_slices(
        "policy", 2, slices=slices, layout="cols", timeout=30
    )
    assert torch.equal(out, _model(cols)["w"][:, cols - take :])
    assert got.range_failures == []
    assert got.served

    needed = _needed(cols, take)
    per_chunk = Counter(r.chunk for r in asked)
    layout = Layout.from_tensors(_model(cols), chunk_size=CHUNK)
    assert sorted(asked, key=_at) == bounded(needed, layout)
    assert set(per_chunk) == {r.chunk for r in needed}
    assert max(per_chunk.values()) <= max_ranges(CHUNK)
    sent = {i: n for (v, i), n in counter.frames.items() if v == 2}
    assert sent == dict(per_chunk)  # on the wire: one frame per range asked, no whole-chunk GET
    if whole:  # each chunk in one range of all of it; the rows' ranges were many more
        assert all(r.offset == 0 and r.length == layout.payload_bytes(r.chunk) for r in asked)
        assert len(asked) < len(needed)
        assert got.bytes_per_source == {trainer.holder_name: layout.total_bytes}
    else:  # the rows' ranges as they are: too far apart to merge, few enough to ask
        pairs = itertools.pairwise(needed)
        assert min(b.offset - a.offset - a.length for a, b in pairs if a.chunk == b.chunk) >= GAP
        assert sorted(asked, key=_at) == needed
        assert got.bytes_per_source == {trainer.holder_name: out.numel() * out.element_size()}

    # a second reader of the block set reads the first's verified blocks: the gap bytes
    # the first received are not among what it serves
    out2, slices2 = _slices(cols, take, 1)
    again = clients().fetch_slices("policy", 2, slices=slices2, layout="cols", timeout=30)
    assert trainer.holder_name not in again.bytes_per_source
    assert torch.equal(out2, out)
