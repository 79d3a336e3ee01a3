"""Tests for transport.rdma.

Two kinds: the pure parts (availability probe, descriptor codec, seqlock decision, read
planning, queue-pair attributes) run everywhere; the data path needs a real RDMA device
(hardware or Soft-RoCE) and is skipped, with the probe's reason, where there is none.
Nothing here fakes or simulates a device.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorhub.errors import IntegrityError, TornRead, TransportError
from transport.rdma import (
    QpInfo,
    RdmaDescriptor,
    RdmaDevice,
    RdmaExporter,
    RdmaReader,
    RegionInfo,
    bump_epoch,
    decode_descriptor,
    decode_endpoint,
    encode_descriptor,
    encode_endpoint,
    epoch_ok,
    plan_reads,
    rdma_available,
    rdma_unavailable_reason,
)
from transport.rdma.availability import probe
from transport.rdma.descriptor import MAX_ENCODED_BYTES, MTU_BYTES

U64 = (1 << 64) - 1
GID = "fe80:0000:0000:0000:0202:c9ff:fe00:0001"
QP = QpInfo(qpn=0x12, psn=7, lid=1, gid=GID, port=1, mtu=1024)

needs_rdma = pytest.mark.skipif(
    not rdma_available(), reason=f"needs an RDMA device: {rdma_unavailable_reason()}"
)

# --- availability -------------------------------------------------------------------------


def test_probe_is_quick_consistent_and_never_raises() -> None:
    probe.cache_clear()
    start = time.monotonic()
    available = rdma_available()
    assert time.monotonic() - start < 5
    assert isinstance(available, bool)
    reason = rdma_unavailable_reason()
    if available:
        assert reason == ""
    else:
        assert reason.startswith(("pyverbs not installed", "pyverbs failed", "no RDMA device"))
    start = time.monotonic()
    assert rdma_available() is available  # cached
    assert time.monotonic() - start < 0.01


@pytest.mark.skipif(rdma_available(), reason="this machine has a usable RDMA device")
def test_device_open_without_rdma_raises_transport_error_with_reason() -> None:
    with pytest.raises(TransportError, match="RDMA unavailable"):
        RdmaDevice()


def test_package_imports_and_reports_when_pyverbs_is_missing() -> None:
    # A fresh interpreter where `import pyverbs` fails, as on a machine without the package.
    code = (
        "import sys; sys.modules['pyverbs'] = None\n"
        "import transport.rdma as r\n"
        "from tensorhub.errors import TransportError\n"
        "assert r.rdma_available() is False\n"
        "print(r.rdma_unavailable_reason())\n"
        "try:\n    r.RdmaDevice()\nexcept TransportError as ex:\n    print('raised', ex)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    assert out.startswith("pyverbs not installed")
    assert "raised RDMA unavailable: pyverbs not installed" in out


# --- descriptor codec -----------------------------------------------------------------------

gids = st.lists(st.integers(0, 0xFFFF), min_size=8, max_size=8).map(
    lambda g: ":".join(f"{x:04x}" for x in g)
)
qp_infos = st.builds(
    QpInfo,
    qpn=st.integers(0, (1 << 24) - 1),
    psn=st.integers(0, (1 << 24) - 1),
    lid=st.integers(0, 0xFFFF),
    gid=gids,
    port=st.integers(1, 255),
    mtu=st.sampled_from(MTU_BYTES),
)
regions = st.builds(
    RegionInfo,
    name=st.text(min_size=1, max_size=40),
    addr=st.integers(0, 1 << 60),
    rkey=st.integers(0, (1 << 32) - 1),
    length=st.integers(0, 1 << 40),
)
descriptors = st.builds(
    RdmaDescriptor,
    version=st.integers(0, U64),
    epoch=st.integers(0, U64 // 2).map(lambda e: 2 * e),
    epoch_addr=st.integers(1, U64 - 7),
    epoch_rkey=st.integers(0, (1 << 32) - 1),
    regions=st.lists(regions, max_size=20, unique_by=lambda r: r.name).map(tuple),
    qp=qp_infos,
)


@given(descriptors)
def test_descriptor_round_trip(desc: RdmaDescriptor) -> None:
    assert decode_descriptor(encode_descriptor(desc)) == desc


@given(qp_infos)
def test_endpoint_round_trip(info: QpInfo) -> None:
    assert decode_endpoint(encode_endpoint(info)) == info


@given(st.binary(max_size=300))
def test_garbage_bytes_are_rejected_with_transport_error(data: bytes) -> None:
    with pytest.raises(TransportError):
        decode_descriptor(data)
    with pytest.raises(TransportError):
        decode_endpoint(data)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)


@given(json_values)
def test_garbage_json_is_rejected_with_transport_error(value: Any) -> None:
    data = json.dumps(value).encode()
    with pytest.raises(TransportError):
        decode_descriptor(data)


def _valid_doc() -> dict[str, Any]:
    desc = RdmaDescriptor(
        version=3,
        epoch=4,
        epoch_addr=0x1000,
        epoch_rkey=9,
        regions=(RegionInfo("w", 0x2000, 5, 64), RegionInfo("b", 0x3000, 6, 8)),
        qp=QP,
    )
    doc: dict[str, Any] = json.loads(encode_descriptor(desc))
    return doc


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    items = doc.items() if isinstance(doc, dict) else enumerate(doc)
    for key, value in items:
        yield (*prefix, key)
        if isinstance(value, dict | list):
            yield from _paths(value, (*prefix, key))


def _at(doc: Any, path: tuple[Any, ...]) -> tuple[Any, Any]:
    for key in path[:-1]:
        doc = doc[key]
    return doc, path[-1]


@pytest.mark.parametrize("path", list(_paths(_valid_doc())), ids=str)
def test_each_missing_or_mistyped_field_is_rejected(path: tuple[Any, ...]) -> None:
    for mutate in ("delete", "bool", "string", "negative"):
        doc = _valid_doc()
        parent, key = _at(doc, path)
        if mutate == "delete":
            if isinstance(parent, list):
                continue  # dropping a region is a smaller, still valid descriptor
            del parent[key]
        elif mutate == "bool":
            parent[key] = True
        elif mutate == "string":
            if isinstance(parent[key], str):
                continue
            parent[key] = "7"
        elif isinstance(parent[key], int):
            parent[key] = -1
        else:
            continue
        with pytest.raises(TransportError):
            decode_descriptor(json.dumps(doc).encode())


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("format",), "tensorhub.rdma/2"),
        (("byteorder",), "big" if sys.byteorder == "little" else "little"),
        (("epoch", "value"), 5),  # odd: the holder was mid-overwrite
        (("epoch", "addr"), 0),
        (("epoch", "rkey"), 1 << 32),
        (("version",), 1 << 64),
        (("qp", "qpn"), 1 << 24),
        (("qp", "psn"), 1 << 24),
        (("qp", "lid"), 1 << 16),
        (("qp", "port"), 0),
        (("qp", "mtu"), 1500),
        (("qp", "gid"), "fe80::1"),
        (("qp", "gid"), GID.upper()),
        (("regions", 1, "name"), "w"),  # duplicate name
        (("regions", 0, "name"), ""),
        (("regions", 0, "addr"), U64),  # addr + length wraps
        (("regions",), {"w": 1}),
        (("epoch",), [1, 2]),
    ],
)
def test_out_of_range_values_are_rejected(path: tuple[Any, ...], value: Any) -> None:
    doc = _valid_doc()
    parent, key = _at(doc, path)
    parent[key] = value
    with pytest.raises(TransportError):
        decode_descriptor(json.dumps(doc).encode())


def test_oversized_and_non_bytes_input_is_rejected() -> None:
    with pytest.raises(TransportError, match="over"):
        decode_descriptor(b" " * (MAX_ENCODED_BYTES + 1))
    with pytest.raises(TransportError):
        decode_descriptor("{}")  # type: ignore[arg-type]


def test_region_lookup_names_the_missing_region() -> None:
    desc = decode_descriptor(json.dumps(_valid_doc()).encode())
    assert desc.region("b") == RegionInfo("b", 0x3000, 6, 8)
    with pytest.raises(TransportError, match="'nope'"):
        desc.region("nope")


# --- seqlock decision -----------------------------------------------------------------------


def test_torn_read_is_an_integrity_error() -> None:
    assert issubclass(TornRead, IntegrityError)
    assert not issubclass(TornRead, TransportError)


@pytest.mark.parametrize(
    ("before", "after", "expected", "ok"),
    [
        (0, 0, None, True),
        (2, 2, 2, True),
        (2, 2, 0, False),  # memory now holds another version
        (1, 1, None, False),  # writer active for the whole read
        (2, 3, None, False),  # writer started during the read
        (1, 2, None, False),  # writer finished during the read
        (2, 4, None, False),  # a whole overwrite happened during the read
        (U64 - 1, U64 - 1, U64 - 1, True),  # the last even value before the wrap
        (U64, U64, None, False),  # odd, just before the wrap
        (U64, 0, None, False),  # the writer's end bump wrapped to 0
        (0, 0, 0, True),  # after the wrap, 0 is a clean epoch again
    ],
)
def test_epoch_ok_table(before: int, after: int, expected: int | None, ok: bool) -> None:
    assert epoch_ok(before, after, expected) is ok


def test_bump_wraps_and_keeps_alternating_parity() -> None:
    assert bump_epoch(U64) == 0
    assert bump_epoch(U64 - 1) == U64
    e = U64 - 3
    for _ in range(8):
        nxt = bump_epoch(e)
        assert nxt % 2 != e % 2
        e = nxt


@given(st.integers(0, U64), st.integers(0, U64))
def test_epoch_ok_property(before: int, after: int) -> None:
    assert epoch_ok(before, after) == (before == after and before % 2 == 0)
    # Any overwrite (odd bump, then even bump) between the reads is caught.
    assert not epoch_ok(before, bump_epoch(before))
    assert not epoch_ok(before, bump_epoch(bump_epoch(before)))


# --- read planning and queue-pair attributes -----------------------------------------------


@given(st.integers(1, 1 << 24), st.integers(0, 4096), st.integers(0, (1 << 24) - 1))
@settings(max_examples=200)
def test_plan_reads_covers_the_chunk_in_order(max_wr: int, whole: int, rest: int) -> None:
    length = whole * max_wr + rest % max_wr
    pieces = plan_reads(length, max_wr)
    assert sum(size for _, size in pieces) == length
    assert all(0 < size <= max_wr for _, size in pieces)
    assert [off for off, _ in pieces] == list(range(0, length, max_wr))


def test_connect_attr_builds_the_rc_transition_attributes() -> None:
    pytest.importorskip("pyverbs.qp", reason="pyverbs not installed")
    from transport.rdma import _verbs
    from transport.rdma.qp import connect_attr

    v = _verbs.load()
    remote = QpInfo(qpn=0x1234, psn=77, lid=3, gid=GID, port=2, mtu=4096)
    attr = connect_attr(
        v,
        port=1,
        gid_index=3,
        local_mtu=1024,
        local_psn=55,
        remote=remote,
        access=v.enums.IBV_ACCESS_REMOTE_READ,
        max_rd_atomic=16,
        max_dest_rd_atomic=8,
    )
    assert (attr.dest_qp_num, attr.rq_psn, attr.sq_psn) == (0x1234, 77, 55)
    assert attr.path_mtu == v.enums.IBV_MTU_1024  # the smaller side wins
    assert attr.qp_access_flags == v.enums.IBV_ACCESS_REMOTE_READ
    assert (attr.max_rd_atomic, attr.max_dest_rd_atomic) == (16, 8)
    ah = attr.ah_attr
    assert (ah.is_global, ah.dgid, ah.sgid_index, ah.dlid, ah.port_num) == (1, GID, 3, 3, 1)


# --- data path on a real device (skipped without one) --------------------------------------


@pytest.fixture
def device() -> Iterator[RdmaDevice]:
    dev = RdmaDevice()
    yield dev
    dev.close()


def _connect(dev: RdmaDevice, exporter: RdmaExporter) -> RdmaReader:
    """The handshake as the TCP control channel carries it: JSON bytes both ways."""
    reader = RdmaReader(dev)
    hello = encode_endpoint(reader.endpoint())
    reply = encode_descriptor(exporter.accept(decode_endpoint(hello)))
    reader.connect(decode_descriptor(reply))
    return reader


def _read_whole(reader: RdmaReader, name: str, dst: torch.Tensor, timeout: float = 30.0) -> None:
    """Read all of region `name` into `dst`, a contiguous CPU tensor of its size."""
    reader.read(name, reader.register(dst), timeout=timeout)


@pytest.mark.rdma
@needs_rdma
def test_exporter_registers_tensor_memory_in_place(device: RdmaDevice) -> None:
    src = torch.arange(1024, dtype=torch.float32)
    empty = torch.empty(0)
    exporter = RdmaExporter(device, {"w": src, "e": empty}, version=1)
    reader = RdmaReader(device)
    try:
        desc = exporter.accept(reader.endpoint())
        w = desc.region("w")
        assert (w.addr, w.length) == (src.data_ptr(), 4096)
        assert desc.region("e").length == 0
        assert (desc.version, desc.epoch) == (1, 0)
    finally:
        reader.close()
        exporter.close()


@pytest.mark.rdma
@needs_rdma
def test_loopback_read_of_64_mib_is_byte_identical(device: RdmaDevice) -> None:
    src = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    exporter = RdmaExporter(device, {"w": src}, version=7)
    reader = _connect(device, exporter)
    try:
        _read_whole(reader, "w", dst, timeout=60)
        assert torch.equal(src, dst)
        # One chunk, at an offset, into the middle of another buffer.
        part = torch.zeros(3 << 20, dtype=torch.uint8)
        reader.read("w", reader.register(part), offset=5 << 20, length=1 << 20, dest_offset=1 << 20)
        assert torch.equal(part[1 << 20 : 2 << 20], src[5 << 20 : 6 << 20])
        assert not part[: 1 << 20].any()
    finally:
        reader.close()
        exporter.close()


@pytest.mark.rdma
@needs_rdma
def test_overwrite_during_a_read_is_detected_as_torn(device: RdmaDevice) -> None:
    src = torch.randint(0, 256, (16 << 20,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    exporter = RdmaExporter(device, {"w": src}, version=1)
    reader = _connect(device, exporter)
    try:
        buf = reader.register(dst)
        with pytest.raises(TornRead, match="moved 0 -> 1"):
            reader.read("w", buf, on_data_posted=exporter.begin_overwrite)
        with pytest.raises(TransportError, match="overwriting"):
            exporter.accept(QP)
        src.fill_(1)
        exporter.end_overwrite(2)
        # The old descriptor names version 1, which is gone for good.
        with pytest.raises(TornRead, match="not 0"):
            reader.read("w", buf)
        fresh = _connect(device, exporter)
        _read_whole(fresh, "w", dst)
        assert fresh.descriptor is not None
        assert fresh.descriptor.version == 2
        assert torch.equal(dst, src)
        fresh.close()
    finally:
        reader.close()
        exporter.close()


@pytest.mark.rdma
@needs_rdma
def test_read_after_deregistration_fails_with_transport_error(device: RdmaDevice) -> None:
    src = torch.ones(1 << 20, dtype=torch.uint8)
    exporter = RdmaExporter(device, {"w": src}, version=1)
    reader = _connect(device, exporter)
    try:
        exporter.revoke()
        with pytest.raises(TransportError, match="RDMA READ completed with"):
            _read_whole(reader, "w", torch.zeros_like(src), timeout=10)
        with pytest.raises(TransportError, match="unusable"):
            _read_whole(reader, "w", torch.zeros_like(src), timeout=10)
    finally:
        reader.close()
        exporter.close()
