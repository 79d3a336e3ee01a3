"""Publish-time checksums of declared layouts (docs/design-notes.md, "Publish-time checksums
of declared layouts"): a rollout declares its layout, the publisher computes the wsum64 of
each chunk of its block sets, the hub records them with the version, and the layout's
readers check every chunk a peer sends against them. Through the SDK, against a real hub,
etcd and sockets."""

from __future__ import annotations

import functools
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from itertools import pairwise

import pytest
import torch
import xxhash

import ros
from chaos.holder_faults import Fault
from ros.client import publisher_sums, publishing
from ros.client.hooks import ClientHooks
from ros.client.layouts import block_set
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from tensorhub.declared_records import MAX_DECLARED_LAYOUTS
from tests.ros.layout_model import CHUNK, expected, global_model, slices_for
from tests.ros.test_layout_deltas import same, step
from transport.boxes import Box
from transport.checksums import wsum64_reference
from transport.layout import Layout, dtype_name
from transport.server import send_chunk
from transport.wire import ChunkHeader

TENANT = "rl"


@pytest.fixture
def clients(connect: Callable[..., ros.Hub]) -> Callable[..., ros.Hub]:
    """Clients of tenant `TENANT` (tests/ros/conftest.py's `connect`: closed at the end)."""
    return functools.partial(connect, TENANT)


def _workers(ranks: int) -> list[dict[str, ros.Slice]]:
    return [slices_for(rank, ranks)[1] for rank in range(ranks)]


def _resolve(
    reader: ros.Hub, layout: str, rank: int, ranks: int, version: int
) -> pb.ResolveLayoutResponse:
    blocks = block_set(slices_for(rank, ranks)[1], CHUNK)
    request = pb.ResolveLayoutRequest(
        model="policy", version=version, layout=layout, block_set=blocks.id
    )
    return reader._rpc("ResolveLayout", request)


def _wsum64_of_blocks(rank: int, ranks: int) -> list[int]:
    """The wsum64 of every chunk of a TP-`ranks` worker's block set, from the global model's
    bytes, in plain numpy (`wsum64_reference`): each block one tensor, sorted by name."""
    return _reference_sums(expected(rank, ranks))


def test_the_hub_records_the_publishers_wsum64_of_each_declared_chunk_with_the_version(
    clients: Callable[..., ros.Hub],
) -> None:
    trainer, rollout = clients(), clients()
    trainer.publish("policy", 1, global_model(), chunk_size=CHUNK)
    rollout.declare_layout("policy", "tp2", _workers(2))
    assert rollout.declared_layouts("policy") == {"tp2": 2}
    # the trainer read no declaration before: its publish is refused once (LayoutsChanged),
    # it reads them and publishes again, with the checksums
    trainer.publish("policy", 2, global_model(), chunk_size=CHUNK)
    for rank in range(2):
        found = _resolve(rollout, "tp2", rank, 2, 2)
        assert list(found.publisher_sums) == _wsum64_of_blocks(rank, 2)
        assert list(found.block_sums) == []  # no reader recorded any: these are the publisher's
        assert list(_resolve(rollout, "tp2", rank, 2, 1).publisher_sums) == []  # before it
    assert list(_resolve(rollout, "tp4", 0, 4, 2).publisher_sums) == []  # not declared


@dataclass
class Liar(Fault):
    """A holder's sender that changes a byte of every chunk and puts the xxh3-64 of the
    changed bytes in the CHUNK frame: false bytes with a checksum that matches them."""

    def __call__(
        self, conn: socket.socket, header: ChunkHeader, views: list[memoryview], complete: bool
    ) -> None:
        if header.length:
            data = bytearray(b"".join(views))
            data[len(data) // 2] ^= 0xFF
            views = [memoryview(data)]
            header = replace(header, checksum=xxhash.xxh3_64_intdigest(bytes(data)))
        send_chunk(conn, header, views, complete)


@dataclass
class Gate(Fault):
    """A trainer's sender that sends nothing while `opened` is clear (at most 20 s)."""

    opened: threading.Event = field(default_factory=threading.Event)

    def __call__(
        self, conn: socket.socket, header: ChunkHeader, views: list[memoryview], complete: bool
    ) -> None:
        self.opened.wait(20)
        super().__call__(conn, header, views, complete)


def _holders(reader: ros.Hub, layout: str, at_least: int) -> list[pb.Holder]:
    deadline = time.monotonic() + 15
    while len(found := list(_resolve(reader, layout, 0, 2, 2).holders)) < at_least:
        assert time.monotonic() < deadline, f"{len(found)} holders registered, not {at_least}"
        time.sleep(0.05)
    return found


@pytest.mark.slow  # two reads that wait on a gate
@pytest.mark.parametrize("declared", [True, False])
def test_a_declared_layouts_reader_catches_a_peer_whose_frames_match_its_false_bytes(
    clients: Callable[..., ros.Hub], declared: bool
) -> None:
    """A PARTIAL holder that sends false bytes with matching checksums in its CHUNK frames:
    in a declared layout its readers check each chunk against the publisher's wsum64 and
    drop it; in a layout not declared (the control) there is nothing else to check against,
    and its reader takes the false bytes."""
    gate = Gate()
    trainer = clients(hooks=ClientHooks(send=gate))
    trainer.publish("policy", 1, global_model(), chunk_size=CHUNK)
    layout = "tp2" if declared else "tp2u"
    if declared:
        clients().declare_layout("policy", layout, _workers(2))
    trainer.publish("policy", 2, global_model(), chunk_size=CHUNK)
    liar, reader, watcher = clients(hooks=ClientHooks(send=Liar())), clients(), clients()
    out, slices = slices_for(0, 2)
    with ThreadPoolExecutor(2) as pool:
        lying = pool.submit(
            liar.fetch_slices, "policy", 2, slices=slices_for(0, 2)[1], layout=layout, timeout=30
        )
        _holders(watcher, layout, 1)  # the liar registered first: it reads from the trainer
        fetching = pool.submit(
            reader.fetch_slices, "policy", 2, slices=slices, layout=layout, timeout=30
        )
        _holders(watcher, layout, 2)  # the reader registered behind it: it reads from it
        gate.opened.set()
        got = fetching.result(timeout=60)
        lied = lying.result(timeout=60)
    honest = all(torch.equal(out[n], want) for n, want in expected(0, 2).items())
    if not declared:
        assert got.bytes_per_source.get(liar.holder_name, 0) > 0
        assert not honest  # believed: what the publisher sums add
        return  # (whichever of the two registers COMPLETE first makes the record)
    assert honest
    assert lied.served  # its own bytes are the publisher's, and the record is made of them
    assert liar.holder_name in got.failed_sources
    assert "Integrity" in got.failed_sources[liar.holder_name]
    assert got.bytes_per_source.get(liar.holder_name, 0) == 0  # no byte of it was kept
    assert got.from_trainer == set(slices)
    assert got.served


def test_a_layout_declared_after_the_publish_takes_the_reader_derived_path(
    clients: Callable[..., ros.Hub],
) -> None:
    trainer = clients()
    trainer.publish("policy", 1, global_model(), chunk_size=CHUNK)
    clients().declare_layout("policy", "tp2", _workers(2))
    first, second = clients(), clients()
    assert list(_resolve(first, "tp2", 1, 2, 1).publisher_sums) == []
    out1, slices1 = slices_for(1, 2)
    got1 = first.fetch_slices("policy", 1, slices=slices1, layout="tp2", timeout=30)
    assert got1.bytes_per_source == {trainer.holder_name: got1.total_bytes}
    assert got1.served
    out2, slices2 = slices_for(1, 2)
    got2 = second.fetch_slices("policy", 1, slices=slices2, layout="tp2", timeout=30)
    assert set(got2.bytes_per_source) == {first.holder_name}  # checked against the record
    assert got2.served
    for out in (out1, out2):
        for name, want in expected(1, 2).items():
            assert torch.equal(out[name], want), name
    assert got2.publisher_checked == 0  # v1 was published before the declaration
    assert list(_resolve(first, "tp2", 1, 2, 1).publisher_sums) == []
    trainer.publish("policy", 2, global_model(), chunk_size=CHUNK)
    assert list(_resolve(first, "tp2", 1, 2, 2).publisher_sums) == _wsum64_of_blocks(1, 2)
    # v2, published after it: a peer's every chunk is checked against the publisher's sums
    first.fetch_slices("policy", 2, slices=slices_for(1, 2)[1], layout="tp2", timeout=30)
    out3, slices3 = slices_for(1, 2)
    got3 = second.fetch_slices("policy", 2, slices=slices3, layout="tp2", timeout=30)
    assert set(got3.bytes_per_source) == {first.holder_name}
    assert got3.publisher_checked == got3.chunks == len(_wsum64_of_blocks(1, 2)) > 0
    for name, want in expected(1, 2).items():
        assert torch.equal(out3[name], want), name


def test_a_cover_is_checked_against_the_publishers_sums_of_the_block_sets_it_reads(
    clients: Callable[..., ros.Hub],
) -> None:
    """A TP-1 reader covered by TP-2 holders checks each chunk of their block sets against
    the publisher's wsum64 where "tp2" was declared before the version's publish (v2), and
    against the block sets' records where it was not (v1); its bytes are the trainer's."""
    trainer = clients()
    trainer.publish("policy", 1, global_model(), chunk_size=CHUNK)
    clients().declare_layout("policy", "tp2", _workers(2))
    trainer.publish("policy", 2, global_model(), chunk_size=CHUNK)
    tp2 = [clients(), clients()]
    for version in (1, 2):
        for rank, worker in enumerate(tp2):
            slices = slices_for(rank, 2)[1]
            assert worker.fetch_slices("policy", version, slices=slices, layout="tp2").served
    for version, published in ((1, False), (2, True)):
        out, slices = slices_for(0, 1)
        got = clients().fetch_slices(
            "policy", version, slices=slices, layout="tp1", cover=("tp2",), timeout=30
        )
        assert got.from_trainer == set()
        assert set(got.bytes_per_source) == {w.holder_name for w in tp2}
        assert got.chunks > 0
        assert got.publisher_checked == (got.chunks if published else 0)
        for name, want in expected(0, 1).items():
            assert torch.equal(out[name], want), name


def test_declared_layouts_past_the_bound_are_refused_by_name(
    clients: Callable[..., ros.Hub],
) -> None:
    rollout = clients()
    with pytest.raises(ros.VersionNotFound):
        rollout.declare_layout("policy", "tp2", _workers(2))  # no version yet
    clients().publish("policy", 1, global_model(), chunk_size=CHUNK)
    names = [f"tp{1 << i}" for i in range(MAX_DECLARED_LAYOUTS)]
    for name in names:
        rollout.declare_layout("policy", name, _workers(int(name[2:])))
    rollout.declare_layout("policy", names[0], _workers(1))  # declared again: replaced
    with pytest.raises(ros.TooManyDeclaredLayouts, match="retire one"):
        rollout.declare_layout("policy", "extra", _workers(2))
    assert set(rollout.declared_layouts("policy")) == set(names)
    assert rollout.retire_layout("policy", names[-1])
    assert not rollout.retire_layout("policy", names[-1])
    rollout.declare_layout("policy", "extra", _workers(2))
    assert set(rollout.declared_layouts("policy")) == {*names[:-1], "extra"}
    with pytest.raises(ros.InvalidArgument):
        rollout.declare_layout("policy", "empty", [])


@pytest.mark.parametrize("gaps", [False, True])
def test_a_block_sets_sums_are_the_wsum64_of_its_chunks_whatever_its_padding(gaps: bool) -> None:
    """`block_set_sums` (one pass over whole chunks when the block set's layout has no
    padding, chunk by chunk when it has) against plain numpy over each chunk's bytes, in
    groups smaller than the block set (`GROUP_BYTES`) and with a short last chunk."""
    g = torch.Generator().manual_seed(3)
    rows = 151 if gaps else 150  # rows of 32 bytes: 4,832 is not a multiple of 64, 4,800 is
    tensors = {
        "a": torch.randn(200, 8, generator=g),
        "b": torch.randint(0, 255, (90, 40), generator=g, dtype=torch.uint8),
        "c": torch.randn(2048, generator=g).to(torch.bfloat16),
    }
    boxes = {"a": ((4, 0), (rows, 8)), "b": ((0, 8), (90, 32)), "c": ((0,), (2048,))}
    blocks = {
        name: (dtype_name(tensors[name].dtype), tuple(tensors[name].shape), Box(o, s))
        for name, (o, s) in boxes.items()
    }
    chunk = 4096
    original = publisher_sums.GROUP_BYTES
    publisher_sums.GROUP_BYTES = chunk
    try:
        block_id, sums = publisher_sums.block_set_sums(blocks, tensors, chunk)
    finally:
        publisher_sums.GROUP_BYTES = original
    parts = {
        name: tensors[name][Box(o, s).slices_in(Box((0,) * len(o), tuple(tensors[name].shape)))]
        for name, (o, s) in boxes.items()
    }
    layout = Layout.from_tensors({k: parts[k].contiguous() for k in sorted(parts)}, chunk)
    assert gaps == any(a.offset + a.nbytes != b.offset for a, b in pairwise(layout.tensors))
    flats = [
        parts[s.name].contiguous().reshape(-1).view(torch.uint8).numpy() for s in layout.tensors
    ]
    want = [
        wsum64_reference(
            b"".join(
                flats[s.tensor][s.start : s.start + s.length].tobytes() for s in layout.segments(i)
            )
        )
        for i in range(layout.num_chunks)
    ]
    assert sums == want
    assert layout.num_chunks > 2  # more than one group
    slices = {
        name: ros.Slice(torch.empty(s, dtype=tensors[name].dtype), o, tuple(tensors[name].shape))
        for name, (o, s) in boxes.items()
    }
    assert block_id == block_set(slices, chunk).id  # the id its readers compute


def test_a_delta_reader_of_a_declared_layout_ends_on_the_publishers_sums(
    clients: Callable[..., ros.Hub],
) -> None:
    """Whole publishes with deltas: a TP-2 worker at version 1 takes version 2's changes
    inside its blocks, each result chunk checked against the record and the publisher's
    wsum64 (`layout_delta`), serves them, and the next reader of those blocks reads every
    byte from it, checked against the publisher's sums."""
    trainer, rollout = clients(), clients()
    reader, second = clients(), clients()
    w1 = global_model()
    trainer.publish("policy", 1, w1, chunk_size=CHUNK, delta=True)
    rollout.declare_layout("policy", "tp2", _workers(2))
    out, slices = slices_for(0, 2)
    assert reader.fetch_slices(
        "policy", 1, slices=slices, layout="tp2", delta=True, timeout=30
    ).served
    assert reader.release_blocks("policy", 1)
    w2 = step(w1, 2)
    trainer.publish("policy", 2, w2, chunk_size=CHUNK, delta=True)
    assert len(_resolve(rollout, "tp2", 0, 2, 2).publisher_sums) > 0
    got = reader.fetch_slices("policy", 2, slices=slices, layout="tp2", delta=True, timeout=30)
    want = {
        name: w2[name][
            slices[name].box.slices_in(Box((0,) * w2[name].dim(), tuple(w2[name].shape)))
        ]
        for name in w2
    }
    assert same(out, {n: t.contiguous() for n, t in want.items()})
    assert got.served
    assert sum(s.chunks for s in got.deltas.values()) > 0
    assert all(s.base_mismatch == 0 for s in got.deltas.values())
    blocks = sum(t.numel() * t.element_size() for t in out.values())
    assert got.total_bytes < blocks / 4  # its results passed both checks: none read whole
    out2, slices2 = slices_for(0, 2)
    again = second.fetch_slices("policy", 2, slices=slices2, layout="tp2", timeout=30)
    assert same(out2, {n: t.contiguous() for n, t in want.items()})
    assert set(again.bytes_per_source) == {reader.holder_name}
    assert again.served


def test_a_publisher_sums_what_it_holds_within_the_bound_and_nothing_past_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A declared block set the published tensors do not hold (another dtype) is skipped;
    past `MAX_PUBLISHER_SUMS` chunks in all, none is sent, counted before any is summed."""
    tensors = global_model()
    declared = {"tp2": [publisher_sums.rows_of(w) for w in _workers(2)]}
    sums = publisher_sums.layout_sums(declared, tensors, CHUNK)
    assert [list(s.sums) for s in sums] == [_wsum64_of_blocks(r, 2) for r in range(2)]
    assert [s.block_set for s in sums] == [block_set(w, CHUNK).id for w in _workers(2)]
    other = dict(tensors, **{"norm.weight": tensors["norm.weight"].double()})
    assert len(publisher_sums.layout_sums(declared, other, CHUNK)) == 0
    chunks = sum(len(s.sums) for s in sums)
    monkeypatch.setattr(publisher_sums, "MAX_PUBLISHER_SUMS", chunks - 1)
    assert publisher_sums.layout_sums(declared, tensors, CHUNK) == []


def _reference_sums(blocks: dict[str, torch.Tensor]) -> list[int]:
    """The wsum64 of every chunk of the block set `blocks` (each one tensor, sorted by
    name), in plain numpy."""
    ordered = {name: t.contiguous() for name, t in sorted(blocks.items())}
    layout = Layout.from_tensors(ordered, chunk_size=CHUNK)
    flats = [ordered[s.name].reshape(-1).view(torch.uint8).numpy() for s in layout.tensors]
    return [
        wsum64_reference(
            b"".join(
                flats[s.tensor][s.start : s.start + s.length].tobytes() for s in layout.segments(i)
            )
        )
        for i in range(layout.num_chunks)
    ]


def test_shards_of_two_ranks_add_up_to_the_publishers_sums_a_straddling_word_included(
    clients: Callable[..., ros.Hub], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two trainer ranks publish their shards: split tensors (one split inside an 8-byte
    word: bf16 columns 0-6 and 7-15, so byte 14 of each row starts rank 1's bytes) and
    replicated ones (both ranks' parts the same: counted once). The hub's sums for a
    declared TP-1 layout are the wsum64 of the whole model's chunks, and a TP-1 reader
    reads every byte from the first, checked against them."""
    g = torch.Generator().manual_seed(5)
    model = dict(
        global_model(), **{"odd.weight": torch.randn(4, 16, generator=g).to(torch.bfloat16)}
    )
    cols = {0: (0, 7), 1: (7, 16)}

    def shard(
        rank: int,
    ) -> tuple[dict[str, torch.Tensor], dict[str, tuple[tuple[int, ...], tuple[int, ...]]]]:
        from tests.ros.layout_model import block

        tensors, placements = {}, {}
        for name, tensor in model.items():
            if name == "odd.weight":
                lo, hi = cols[rank]
                tensors[name] = tensor[:, lo:hi].contiguous()
                placements[name] = (tuple(tensor.shape), (0, lo))
                continue
            offsets, shape = block(name, rank, 2)
            index = tuple(slice(o, o + s) for o, s in zip(offsets, shape, strict=True))
            tensors[name] = tensor[index].contiguous()
            if name.endswith(("qkv.weight", "o.weight")):
                placements[name] = (tuple(tensor.shape), offsets)
        return tensors, placements

    # a rank reads the declarations at most every DECLARED_TTL: here at every publish
    monkeypatch.setattr(publishing, "DECLARED_TTL", 0.0)
    ranks = [clients(), clients()]
    for rank, trainer in enumerate(ranks):
        tensors, placements = shard(rank)
        trainer.publish(
            "policy", 1, tensors, shard=(rank, 2), placements=placements, chunk_size=CHUNK
        )
    out1 = {n: torch.empty_like(t) for n, t in model.items()}
    whole = {n: ros.Slice(out1[n], (0,) * t.dim(), tuple(t.shape)) for n, t in model.items()}
    rollout = clients()
    rollout.declare_layout("policy", "tp1", [whole])
    for rank, trainer in enumerate(ranks):
        tensors, placements = shard(rank)
        trainer.publish(
            "policy", 2, tensors, shard=(rank, 2), placements=placements, chunk_size=CHUNK
        )
    request = pb.ResolveLayoutRequest(
        model="policy", version=2, layout="tp1", block_set=block_set(whole, CHUNK).id
    )
    sums = list(rollout._rpc("ResolveLayout", request).publisher_sums)
    assert sums == _reference_sums(model)
    request.version = 1  # published before the declaration
    assert list(rollout._rpc("ResolveLayout", request).publisher_sums) == []
    first, second = clients(), clients()
    got1 = first.fetch_slices("policy", 2, slices=whole, layout="tp1", timeout=30)
    assert got1.served
    out2 = {n: torch.empty_like(t) for n, t in model.items()}
    slices2 = {n: ros.Slice(out2[n], (0,) * t.dim(), tuple(t.shape)) for n, t in model.items()}
    got2 = second.fetch_slices("policy", 2, slices=slices2, layout="tp1", timeout=30)
    assert set(got2.bytes_per_source) == {first.holder_name}  # checked against the sums
    for name, want in model.items():
        assert torch.equal(out1[name], want), name
        assert torch.equal(out2[name], want), name
