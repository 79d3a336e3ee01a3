"""Fetch over real sockets from in-process holders: copies, integrity, chains, release."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from chaos.holder_faults import Fault
from tensorhub.errors import (
    IntegrityError,
    InvalidArgument,
    PermissionDenied,
    VersionUnavailable,
)
from tests.transport._model import MODEL, TENANT, make_model
from tests.transport.conftest import StartHolder
from tests.transport.open_verifier import allow_all
from transport.layout import Layout
from transport.reader import FetchStats, Source, fetch, read_round
from transport.server import HolderServer
from transport.store import HeldVersion, HolderStore
from transport.topology import Topology

CHUNK = 64 * 1024


def _fetch(
    layout: Layout, sources: list[Source], dest: HeldVersion | None = None, **kw: object
) -> tuple[HeldVersion, FetchStats]:
    dest = dest or HeldVersion.reader(TENANT, MODEL, 1, layout, layout.allocate())
    opts: dict[str, object] = {"token": b"t", "deadline": time.monotonic() + 20, "me": Topology()}
    opts.update(kw)
    stats = fetch(TENANT, MODEL, 1, layout, dest, sources, **opts)  # type: ignore[arg-type]
    return dest, stats


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a
    )


def test_small_chunks_never_ask_more_than_a_holder_accepts_per_request(
    holders: StartHolder,
) -> None:
    """4 KiB chunks: a 64 MiB batch would be 16,384 chunks, over the wire's 4,096 per GET
    (a holder refuses that request, and every holder looked broken)."""
    model = {"w": torch.arange(24 << 20, dtype=torch.uint8)}  # 24 MiB: 6,144 chunks
    layout = Layout.from_tensors(model, chunk_size=4096)
    dest, stats = _fetch(layout, [holders(model, layout, name="h0")[2]])
    assert dest.complete
    assert _same(dest.tensors, model)
    assert stats.chunks == layout.num_chunks


@pytest.mark.parametrize("n_holders", [1, 3])
def test_fetch_is_byte_identical(holders: StartHolder, n_holders: int) -> None:
    model = make_model(7)  # 2,000 tiny tensors + 3 large ones
    layout = Layout.from_tensors(model, chunk_size=CHUNK)
    sources = [holders(model, layout, name=f"h{i}")[2] for i in range(n_holders)]
    dest, stats = _fetch(layout, sources)
    assert dest.complete
    assert _same(dest.tensors, model)
    payload = sum(layout.payload_bytes(i) for i in range(layout.num_chunks))
    assert stats.total_bytes == payload
    assert stats.refetched_bytes == 0
    assert stats.chunks == layout.num_chunks
    assert len(stats.bytes_per_source) == n_holders  # the plan spreads over every holder


@pytest.mark.parametrize("fault", [Fault(corrupt=True), Fault(wrong_version=True)])
def test_bad_holder_is_detected_and_avoided(holders: StartHolder, fault: Fault) -> None:
    model = make_model(3, tiny=50)
    layout = Layout.from_tensors(model, chunk_size=CHUNK)
    bad = holders(model, layout, name="bad", fault=fault)[2]
    good = holders(model, layout, name="good")[2]
    dest, stats = _fetch(layout, [bad, good])
    assert _same(dest.tensors, model)
    assert "bad" in stats.failed_sources
    assert "IntegrityError" in stats.failed_sources["bad"]
    assert stats.bytes_per_source.get("bad", 0) == 0


@pytest.mark.parametrize("fault", [Fault(corrupt=True), Fault(wrong_version=True)])
def test_bad_only_holder_raises_integrity_error(holders: StartHolder, fault: Fault) -> None:
    model = make_model(3, tiny=50)
    layout = Layout.from_tensors(model, chunk_size=CHUNK)
    bad = holders(model, layout, name="bad", fault=fault)[2]
    with pytest.raises(IntegrityError):
        _fetch(layout, [bad])


def test_token_is_checked(holders: StartHolder) -> None:
    model = make_model(3, tiny=10)
    layout = Layout.from_tensors(model, chunk_size=CHUNK)
    seen: list[tuple[str, str, int, bytes]] = []

    def verifier(tenant: str, model_name: str, version: int, token: bytes) -> bool:
        seen.append((tenant, model_name, version, token))
        return token == b"good"

    source = holders(model, layout, verifier=verifier)[2]
    with pytest.raises(PermissionDenied):
        _fetch(layout, [source], token=b"bad")
    dest, _ = _fetch(layout, [source], token=b"good")
    assert _same(dest.tensors, model)
    assert (TENANT, MODEL, 1, b"good") in seen


def test_no_holder_raises_version_unavailable(holders: StartHolder) -> None:
    model = make_model(3, tiny=10)
    layout = Layout.from_tensors(model, chunk_size=CHUNK)
    other_version = holders(model, layout, version=2)[2]  # holds v2, not v1
    start = time.monotonic()
    with pytest.raises(VersionUnavailable):
        _fetch(layout, [other_version], deadline=time.monotonic() + 10)
    with pytest.raises(VersionUnavailable):
        _fetch(layout, [])
    assert time.monotonic() - start < 5


def test_into_tensors_are_checked_before_any_write() -> None:
    model = make_model(3, tiny=10)
    layout = Layout.from_tensors(model, chunk_size=CHUNK)
    wrong = layout.allocate()
    wrong["norm.1"] = torch.zeros(99)
    with pytest.raises(InvalidArgument, match=r"norm\.1.*shape"):
        HeldVersion.reader(TENANT, MODEL, 1, layout, wrong)
    del wrong["norm.1"]
    with pytest.raises(InvalidArgument, match="missing"):
        HeldVersion.reader(TENANT, MODEL, 1, layout, wrong)


def test_pipelined_chain_trainer_a_b(holders: StartHolder) -> None:
    """B reads only from A while A is still receiving from a throttled trainer."""
    model = make_model(11, tiny=200)
    layout = Layout.from_tensors(model, chunk_size=16 * 1024)
    trainer = holders(model, layout, name="trainer", fault=Fault(chunk_delay=0.01))[2]
    a_store = HolderStore()
    a_dest = HeldVersion.reader(TENANT, MODEL, 1, layout, layout.allocate())
    a_store.add(a_dest)  # registered before its fetch starts: A is a PARTIAL holder
    with HolderServer(a_store, allow_all) as a_server:
        a_thread = threading.Thread(
            target=_fetch, args=(layout, [trainer], a_dest), kwargs={"parallel": 1}
        )
        a_thread.start()
        while len(a_dest.missing()) == layout.num_chunks:
            time.sleep(0.005)
        assert not a_dest.complete  # B starts while A is mid-transfer
        b_dest, b_stats = _fetch(layout, [Source("a", *a_server.address)])
        a_thread.join(timeout=20)
    assert _same(b_dest.tensors, model)
    assert _same(a_dest.tensors, model)
    assert set(b_stats.bytes_per_source) == {"a"}


def test_release_waits_for_read_in_flight_then_refuses(holders: StartHolder) -> None:
    model = make_model(5, tiny=20)
    layout = Layout.from_tensors(model, chunk_size=16 * 1024)
    _, store, source = holders(model, layout, fault=Fault(chunk_delay=0.02))
    held = store.get((TENANT, MODEL, 1))
    assert held is not None
    result: list[FetchStats] = []
    reader = threading.Thread(target=lambda: result.append(_fetch(layout, [source], parallel=1)[1]))
    reader.start()
    while held.reads_in_flight == 0:
        time.sleep(0.002)
    store.release((TENANT, MODEL, 1), timeout=10)  # must wait for the read
    assert held.reads_in_flight == 0
    reader.join(timeout=10)
    assert result
    assert result[0].chunks == layout.num_chunks
    assert store.get((TENANT, MODEL, 1)) is None
    with pytest.raises(VersionUnavailable):
        _fetch(layout, [source])


def test_release_deadline_exceeded_while_read_runs(holders: StartHolder) -> None:
    from tensorhub.errors import DeadlineExceeded

    model = make_model(5, tiny=20)
    layout = Layout.from_tensors(model, chunk_size=16 * 1024)
    _, store, source = holders(model, layout, fault=Fault(chunk_delay=0.05))
    held = store.get((TENANT, MODEL, 1))
    assert held is not None
    reader = threading.Thread(target=lambda: _fetch(layout, [source], parallel=1))
    reader.start()
    while held.reads_in_flight == 0:
        time.sleep(0.002)
    with pytest.raises(DeadlineExceeded):
        held.release(timeout=0.05)
    reader.join(timeout=10)
    assert held.released


def test_partial_holder_without_progress_is_given_up() -> None:
    """A PARTIAL holder whose own fetch never progresses answers NOT_READY; the reader
    gives it up after a stall timeout without progress, long before the deadline."""
    model = make_model(3, tiny=10)
    layout = Layout.from_tensors(model, chunk_size=CHUNK)
    store = HolderStore()
    store.add(HeldVersion.reader(TENANT, MODEL, 1, layout, layout.allocate()))
    with HolderServer(store, allow_all) as server:
        start = time.monotonic()
        with pytest.raises(VersionUnavailable):
            _fetch(
                layout,
                [Source("a", *server.address)],
                stall_timeout=0.4,
                deadline=time.monotonic() + 20,
            )
        assert time.monotonic() - start < 3


def _published_checksums(model: dict[str, torch.Tensor], layout: Layout) -> list[int]:
    held = HeldVersion.publisher(TENANT, MODEL, 1, model, layout)
    return [held.checksum(i) for i in range(layout.num_chunks)]


def test_holder_whose_memory_drifted_is_caught_by_published_checksums(holders: StartHolder) -> None:
    """Bytes that are intact on the wire but not what was published (the holder overwrote
    advertised memory) fail the end-to-end check and are fetched from another holder."""
    model = make_model(5, tiny=50)
    layout = Layout.from_tensors(model, chunk_size=CHUNK)
    expected = _published_checksums(model, layout)
    drifted = {k: v + 1 for k, v in model.items()}  # every chunk drifted; own checksums consistent
    bad = holders(drifted, layout, name="drifted")[2]
    good = holders(model, layout, name="good")[2]
    dest, stats = _fetch(layout, [bad, good], expected=expected)
    assert _same(dest.tensors, model)
    assert "differs from the published version" in stats.failed_sources["drifted"]
    with pytest.raises(IntegrityError, match="published"):
        _fetch(layout, [bad], expected=expected)
    # without the published checksums the drift would have gone unnoticed
    dest, _ = _fetch(layout, [bad])
    assert not _same(dest.tensors, model)


def test_a_round_gives_up_a_corrupt_source_and_never_asks_for_more_sources(
    holders: StartHolder,
) -> None:
    """One round over the sources it is given: a corrupt one is dropped and its chunks read
    from the others; alone, the round ends with the missing chunks and the failure named
    (who else to ask is the SDK orchestrator's call: tests/ros/test_orchestrator.py)."""
    model = make_model(6, tiny=50)
    layout = Layout.from_tensors(model, chunk_size=CHUNK)
    bad = holders(model, layout, name="predecessor", fault=Fault(corrupt=True))[2]
    good = holders(model, layout, name="publisher")[2]
    dest, stats = _fetch(layout, [bad, good])
    assert _same(dest.tensors, model)
    assert "IntegrityError" in stats.failed_sources["predecessor"]
    assert stats.bytes_per_source.get("publisher", 0) > 0
    alone = HeldVersion.reader(TENANT, MODEL, 1, layout, layout.allocate())
    result = read_round(
        TENANT, MODEL, 1, layout, alone, [bad], token=b"t",
        deadline=time.monotonic() + 20, me=Topology(),
    )  # fmt: skip
    assert not result.done
    assert result.missing == list(range(layout.num_chunks))
    assert isinstance(result.failures["predecessor"], IntegrityError)
    with pytest.raises(IntegrityError):
        _fetch(layout, [bad])


def test_a_round_reads_only_the_chunks_asked_for(holders: StartHolder) -> None:
    model = make_model(7, tiny=50)
    layout = Layout.from_tensors(model, chunk_size=CHUNK)
    good = holders(model, layout, name="publisher")[2]
    dest = HeldVersion.reader(TENANT, MODEL, 1, layout, layout.allocate())
    wanted = {1, layout.num_chunks - 1}
    result = read_round(
        TENANT, MODEL, 1, layout, dest, [good], token=b"t",
        deadline=time.monotonic() + 20, me=Topology(), chunks=wanted,
    )  # fmt: skip
    assert result.done
    assert set(range(layout.num_chunks)) - set(dest.missing()) == wanted
