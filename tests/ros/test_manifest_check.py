"""The one manifest validator (`ros.manifest_check`) on its own: it agrees with the layout
rules the SDK builds from a manifest, it accepts every manifest the SDK writes, and it
refuses each malformed case of issue 12 (item 8) by name.

The hub's use of it (refused before any write) is tests/ros/test_malformed_manifests.py.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import transport.layout as layout_module
from ros import raw_manifest, tensor_table
from ros.client.manifest import layout_of
from ros.manifest_check import (
    ALIGN,
    DTYPE_SIZES,
    MAX_CHUNK,
    MAX_LABEL_VALUE_BYTES,
    MAX_METADATA_BYTES,
    MAX_METADATA_ENTRIES,
    MAX_TENSOR_NAME_BYTES,
    MAX_TOPOLOGY_LABELS,
    MIN_CHUNK,
    RESERVED_TENSOR_NAMES,
    _tensors_pass,
    _walk_tensors,
    check_manifest,
    check_manifest_bytes,
    check_topology,
)
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from tensorhub import delta_rules
from tensorhub.errors import InvalidArgument, InvalidManifest
from transport.layout import Layout, dtype_name, torch_dtype


def good(total: int = 8192, chunk: int = 4096) -> pb.Manifest:
    """Two float32 tensors of 4 KiB back to back: a valid manifest to break one rule of."""
    return pb.Manifest(
        tensors=[
            pb.TensorEntry(name="a", dtype="float32", shape=[1024], offset=0, nbytes=4096),
            pb.TensorEntry(name="b", dtype="float32", shape=[1024], offset=4096, nbytes=4096),
        ],
        total_bytes=total,
        chunk_size=chunk,
        chunk_xxh3=[1] * (-(-total // chunk)),
    )


def broken(case: str) -> pb.Manifest:
    """`good()` with one rule of issue 12's list broken."""
    m = good()
    a, b = m.tensors
    if case == "dtype float33":
        a.dtype = "float33"
    elif case == "overlapping offsets":
        b.offset = 0
    elif case == "chunk_size 0":
        m.chunk_size = 0
    elif case == "chunk_size negative":
        m.chunk_size = -4096
    elif case == "checksum count":
        m.chunk_xxh3.append(7)
    elif case == "duplicate names":
        b.name = "a"
    elif case == "offset beyond total_bytes":
        b.offset = 1 << 20
    elif case == "1 TB tensor in a small version":
        b.shape[:] = [1 << 40]
        b.dtype, b.nbytes = "uint8", 1 << 40
    elif case == "nbytes not dtype x shape":
        a.nbytes = 4000
    elif case == "unaligned offset":
        b.offset = 4100
    elif case == "no tensors":
        del m.tensors[:]
    elif case == "negative dimension":
        a.shape[:] = [-1024]
    elif case == "placement outside global shape":
        a.global_shape[:], a.global_offsets[:] = [2048], [1536]
    elif case == "placement of another rank":
        a.global_shape[:], a.global_offsets[:] = [2048, 4], [0]
    elif case == "metadata entries":
        m.metadata.update({f"k{i}": "v" for i in range(MAX_METADATA_ENTRIES + 1)})
    elif case == "metadata bytes":
        m.metadata["blob"] = "x" * MAX_METADATA_BYTES
    elif case == "tensor name length":
        a.name = "x" * (MAX_TENSOR_NAME_BYTES + 1)
    elif case == "unknown checksum algorithm":
        m.checksum = "crc32"  # a reader could not run the check: refused, never skipped
    elif case.startswith("delta "):
        _break_delta(m, case)
    else:
        raise AssertionError(case)
    return m


def good_delta(m: pb.Manifest, model: str = "policy") -> pb.Delta:
    """A valid delta section for `good()`'s two chunks: the first encoded, the second whole."""
    return pb.Delta(
        base=1, encoding=delta_rules.ENCODING, encoded_bytes=[100, 0], encoded_xxh3=[5, 0],
        base_checksum=[3, 4], companion=delta_rules.companion_of(model),
    )  # fmt: skip


def _break_delta(m: pb.Manifest, case: str) -> None:
    """Issue 22, item 6: a delta section whose sizes, digests or base are malformed."""
    m.delta.CopyFrom(good_delta(m))
    d = m.delta
    if case == "delta base not before the version":
        d.base = 1 << 40
    elif case == "delta base 0":
        d.base = 0
    elif case == "delta unknown encoding":
        d.encoding = "xor-gzip"
    elif case == "delta sizes count":
        d.encoded_bytes.append(7)
    elif case == "delta digests count":
        del d.encoded_xxh3[1:]
    elif case == "delta base checksums count":
        d.base_checksum.append(1)
    elif case == "delta size over the whole ratio":
        d.encoded_bytes[0] = m.chunk_size  # larger than 0.8 of the chunk: it goes whole
    elif case == "delta negative size":
        d.encoded_bytes[0] = -1
    elif case == "delta whole chunk with a digest":
        d.encoded_xxh3[1] = 9
    elif case == "delta encodes nothing":
        d.encoded_bytes[0], d.encoded_xxh3[0] = 0, 0
    elif case == "delta companion of another model":
        d.companion = "other.delta"
    elif case == "delta of a wsum64 version without result digests":
        m.checksum = "wsum64"
    elif case == "delta of a wsum64 version with too few result digests":
        m.checksum = "wsum64"
        d.result_xxh3[:] = [1]
    elif case == "delta result digests under a non-linear checksum":
        d.result_xxh3[:] = [1, 2]
    else:
        raise AssertionError(case)


CASES = [
    "dtype float33", "overlapping offsets", "chunk_size 0", "chunk_size negative",
    "checksum count", "duplicate names", "offset beyond total_bytes",
    "1 TB tensor in a small version", "nbytes not dtype x shape", "unaligned offset",
    "no tensors", "negative dimension", "placement outside global shape",
    "placement of another rank", "metadata entries", "metadata bytes", "tensor name length",
    "unknown checksum algorithm", "delta base not before the version", "delta base 0",
    "delta unknown encoding", "delta sizes count", "delta digests count",
    "delta base checksums count", "delta size over the whole ratio", "delta negative size",
    "delta whole chunk with a digest", "delta encodes nothing",
    "delta companion of another model", "delta of a wsum64 version without result digests",
    "delta of a wsum64 version with too few result digests",
    "delta result digests under a non-linear checksum",
]  # fmt: skip


def test_a_valid_manifest_passes() -> None:
    check_manifest(good())
    check_manifest(good(total=8192 + 100, chunk=4096))  # padding after the last tensor
    with_delta = good()
    with_delta.delta.CopyFrom(good_delta(with_delta))
    check_manifest(with_delta, model="policy", version=2)
    with_delta.checksum = "wsum64"
    with_delta.delta.result_xxh3[:] = [7, 8]
    check_manifest(with_delta, model="policy", version=2)


@pytest.mark.parametrize("case", CASES)
def test_each_malformed_case_is_refused_by_name(case: str) -> None:
    with pytest.raises(InvalidManifest, match=r"^manifest: ") as info:
        check_manifest(broken(case), model="policy", version=2)
    assert isinstance(info.value, InvalidArgument)  # INVALID_ARGUMENT on the wire


def _bulk_and_walk_agree(m: pb.Manifest) -> bool:
    """Whether the bulk pass and the entry-by-entry walk agree on `m`'s tensors; which one
    passed, for the caller to assert on."""
    try:
        _walk_tensors(m.tensors, m.total_bytes)
        walked = True
    except InvalidManifest:
        walked = False
    assert _tensors_pass(m.tensors, m.total_bytes) is walked
    return walked


def _renamed(name: str) -> pb.Manifest:
    m = good()
    m.tensors[0].name = name
    return m


def _placed(shape: list[int], offsets: list[int]) -> pb.Manifest:
    m = good()
    m.tensors[0].global_shape[:], m.tensors[0].global_offsets[:] = shape, offsets
    return m


@pytest.mark.parametrize("case", CASES)
def test_the_bulk_pass_refuses_exactly_what_the_walk_refuses(case: str) -> None:
    """check_manifest decides valid tensors in bulk and walks them one by one only to name a
    broken rule: the bulk pass must never pass what the walk refuses, nor refuse what it
    passes."""
    _bulk_and_walk_agree(broken(case))


def test_the_bulk_pass_holds_every_name_and_placement_rule() -> None:
    assert _bulk_and_walk_agree(good())
    assert _bulk_and_walk_agree(_renamed("é" * (MAX_TENSOR_NAME_BYTES // 2)))  # 1,024 bytes
    assert not _bulk_and_walk_agree(_renamed("é" * (MAX_TENSOR_NAME_BYTES // 2 + 1)))
    assert not _bulk_and_walk_agree(_renamed(""))
    assert not _bulk_and_walk_agree(_renamed("__metadata__"))
    assert _bulk_and_walk_agree(_placed([2048], [1024]))
    assert not _bulk_and_walk_agree(_placed([2048], [-1]))
    assert not _bulk_and_walk_agree(_placed([2048], []))
    m = good()
    m.tensors[1].shape[:] = [2, 512]
    assert _bulk_and_walk_agree(m)
    m.tensors[1].shape[:] = [-2, -512]  # the right product of negative dimensions
    assert not _bulk_and_walk_agree(m)
    m.tensors[1].shape[:] = [1] * 64 + [1024]  # 65 dimensions
    assert not _bulk_and_walk_agree(m)
    m = good(total=8000)  # the last tensor ends past total_bytes
    assert not _bulk_and_walk_agree(m)


def _refusal(m: pb.Manifest, serialized: bytes | None) -> str:
    """The message check_manifest refuses `m` with ("" if it passes)."""
    try:
        check_manifest(m, model="policy", version=2, serialized=serialized)
    except InvalidManifest as exc:
        return str(exc)
    return ""


def _same_from_bytes(m: pb.Manifest) -> str:
    """check_manifest of `m` from its bytes (`ros.tensor_table`), and check_manifest_bytes
    of its bytes alone (a hub's group call: `ros.raw_manifest`), refuse exactly as the
    check of the message does, with the same message; which one, for the caller."""
    expected = _refusal(m, None)
    assert _refusal(m, m.SerializeToString()) == expected
    assert _bytes_refusal(m.SerializeToString()) == expected
    return expected


def _bytes_refusal(serialized: bytes) -> str:
    """The message check_manifest_bytes refuses `serialized` with ("" if it passes)."""
    try:
        check_manifest_bytes(serialized, model="policy", version=2)
    except InvalidManifest as exc:
        return str(exc)
    return ""


@pytest.mark.parametrize("case", CASES)
def test_the_check_from_bytes_refuses_each_case_as_the_message_check(case: str) -> None:
    """With the bytes of a manifest, its tensor table is checked from them: each case is
    refused with the same message whether its layout was never seen or a valid manifest of
    another layout passed first."""
    assert _same_from_bytes(broken(case))
    assert _same_from_bytes(good()) == ""  # good()'s layout is remembered as checked
    assert _same_from_bytes(broken(case))


def test_a_remembered_layout_still_has_its_names_and_total_checked() -> None:
    """A layout that passed once passes on its bytes alone, so every name rule must still
    hold for a manifest of the same layout, and another total_bytes is another layout."""
    m = good()
    assert _same_from_bytes(m) == ""
    key = tensor_table.layout_key(m.SerializeToString(), m.total_bytes)
    assert key is not None
    assert tensor_table.passed(key)
    for name in ("", "__metadata__", "b", "x" * (MAX_TENSOR_NAME_BYTES + 1),
                 "é" * (MAX_TENSOR_NAME_BYTES // 2 + 1)):  # fmt: skip
        renamed = _renamed(name)
        renamed_key = tensor_table.layout_key(renamed.SerializeToString(), m.total_bytes)
        assert renamed_key == key  # the same layout: decided by the names' check alone
        assert _same_from_bytes(renamed), name
    assert _same_from_bytes(_renamed("é" * (MAX_TENSOR_NAME_BYTES // 2))) == ""  # 1,024 B
    assert _same_from_bytes(_renamed("ok")) == ""
    short = good()
    short.total_bytes = 8000  # the same entries, the last one now past total_bytes
    short.chunk_xxh3[:] = [1, 1]
    assert "past total_bytes" in _same_from_bytes(short)


def test_one_parse_splits_names_from_the_layout_and_refuses_as_the_walk() -> None:
    """`tensor_table.split`: the names and the layout's key from one parse of the bytes, the
    key told apart from `layout_key`'s and from another layout's (entries' bounds included);
    a table it cannot split (a name too long for one length byte, an empty name) goes to the
    views; every name rule still refuses on a remembered layout, with the walk's message."""
    m = good()
    assert _same_from_bytes(m) == ""
    parts = tensor_table.split(m.SerializeToString(), m.total_bytes)
    assert parts is not None
    key, found = parts
    assert found == [b"a", b"b"]
    assert tensor_table.passed(key)
    assert key != tensor_table.layout_key(m.SerializeToString(), m.total_bytes)
    renamed = tensor_table.split(_renamed("zz").SerializeToString(), m.total_bytes)
    assert renamed is not None
    assert renamed[0] == key  # the same layout, another name
    one = pb.Manifest(total_bytes=m.total_bytes)  # the two entries' rests as one entry's
    rests = b"".join(e.SerializeToString()[3:] for e in m.tensors)  # each less its name
    one.tensors.add().MergeFromString(b"\x0a\x01c" + rests)
    other = tensor_table.split(one.SerializeToString(), m.total_bytes)
    assert other is not None
    assert other[0] != key
    for name in ("x" * 128, ""):
        assert tensor_table.split(_renamed(name).SerializeToString(), m.total_bytes) is None
    for name in ("__metadata__", "b", "x" * (MAX_TENSOR_NAME_BYTES + 1), ""):
        assert _same_from_bytes(_renamed(name)), name
    for name in ("é" * 63, "x" * 128):  # 126 bytes, split; 128, by the views: both valid
        assert _same_from_bytes(_renamed(name)) == "", name


def test_the_rules_are_the_layouts_constants_and_torchs_dtypes() -> None:
    """The hub must not import torch, so the validator restates transport.layout's rules and
    torch's element sizes: held to them here."""
    assert (ALIGN, MIN_CHUNK, MAX_CHUNK) == (
        layout_module.ALIGN,
        layout_module.MIN_CHUNK,
        layout_module.MAX_CHUNK,
    )
    names = {dtype_name(d) for d in vars(torch).values() if isinstance(d, torch.dtype)}
    assert names <= set(DTYPE_SIZES), names - set(DTYPE_SIZES)
    for name, size in DTYPE_SIZES.items():
        if name in names:
            assert torch_dtype(name).itemsize == size, name


_DTYPES = ["float32", "bfloat16", "float16", "int8", "int64", "bool", "float8_e4m3fn"]


@settings(max_examples=60, deadline=None)
@given(
    shapes=st.lists(
        st.tuples(st.sampled_from(_DTYPES), st.lists(st.integers(0, 40), max_size=3)),
        min_size=1,
        max_size=6,
    ),
    chunk=st.sampled_from([MIN_CHUNK, 8192, 1 << 20]),
)
def test_every_manifest_the_sdk_writes_passes(
    shapes: list[tuple[str, list[int]]], chunk: int
) -> None:
    """Whatever tensors a trainer publishes, the manifest the SDK builds passes."""
    tensors = {
        f"t{i}": torch.zeros(shape, dtype=torch_dtype(dtype))
        for i, (dtype, shape) in enumerate(shapes)
    }
    layout = Layout.from_tensors(tensors, chunk)
    manifest = pb.Manifest(
        tensors=[
            pb.TensorEntry(
                name=s.name, dtype=s.dtype, shape=list(s.shape), offset=s.offset, nbytes=s.nbytes
            )
            for s in layout.tensors
        ],
        total_bytes=layout.total_bytes,
        chunk_size=layout.chunk_size,
        chunk_xxh3=[0] * layout.num_chunks,
    )
    check_manifest(manifest)
    assert layout_of(manifest) == layout


@settings(max_examples=200, deadline=None)
@given(
    field=st.sampled_from(["offset", "nbytes", "total_bytes", "chunk_size", "checksums", "dtype"]),
    which=st.integers(0, 1),
    value=st.integers(-(1 << 20), 1 << 21),
    dtype=st.sampled_from(["float32", "bfloat16", "uint8", "float33", "", "Float32"]),
)
def test_the_validator_accepts_exactly_what_the_layout_accepts(
    field: str, which: int, value: int, dtype: str
) -> None:
    """One mutation of a valid manifest: the validator (hub, no torch) and `layout_of` (the
    reader's layout) agree on whether it is usable, so a manifest the hub accepts never
    fails later at fetch, and the validator refuses nothing a reader could use."""
    m = good()
    entry = m.tensors[which]
    if field == "offset":
        entry.offset = value
    elif field == "nbytes":
        entry.nbytes = value
    elif field == "total_bytes":
        m.total_bytes = value
    elif field == "chunk_size":
        m.chunk_size = value
    elif field == "checksums":
        del m.chunk_xxh3[value % 4 :]
    else:
        entry.dtype = dtype
    try:
        layout_of(m)
        layout_ok = True
    except InvalidArgument:
        layout_ok = False
    try:
        check_manifest(m)
        check_ok = True
    except InvalidManifest:
        check_ok = False
    assert check_ok == layout_ok


def test_topology_labels_are_bounded() -> None:
    check_topology({"dc": "dc1", "rack": "r1", "host": "h" * MAX_LABEL_VALUE_BYTES})
    with pytest.raises(InvalidArgument, match="labels"):
        check_topology({f"k{i}": "v" for i in range(MAX_TOPOLOGY_LABELS + 1)})
    with pytest.raises(InvalidArgument, match="at most"):
        check_topology({"zone": "z" * (MAX_LABEL_VALUE_BYTES + 1)})
    with pytest.raises(InvalidArgument, match="must be 1 to"):
        check_topology({"k" * 64: "v"})
    with pytest.raises(InvalidArgument, match="must be 1 to"):
        check_topology({"": "v"})


def _split_entry_by_entry(serialized: bytes, total: int) -> object:
    """`tensor_table.split`'s result as its rules state it (the reference it is held to):
    the entries of one parse, each entry's name and rest sliced in turn."""
    from array import array

    try:
        items = tensor_table._Items.FromString(serialized).tensors
    except Exception:
        return None
    found: list[bytes] = []
    rests: list[bytes] = []
    for item in items:
        size = item[1] if len(item) > 1 and item[0] == 0x0A else 0x80
        if size >= 0x80:
            return None
        found.append(item[2 : 2 + size])
        rests.append(item[2 + size :])
    lengths = array("I", map(len, rests))
    head = b"\x00" + len(rests).to_bytes(4, "little")
    return (head + lengths.tobytes() + b"".join(rests), total), found


_ITEM = st.one_of(
    st.binary(max_size=6),  # empty, one byte, or no name tag: not split
    st.builds(  # a name's tag, its length (128 or more: not split) and arbitrary bytes
        lambda size, body: b"\x0a" + bytes([size]) + body,
        st.integers(0, 255),
        st.binary(max_size=40),
    ),
    st.builds(  # a well-formed entry with a random name
        lambda name, dtype, shape: pb.TensorEntry(
            name=name, dtype=dtype, shape=shape, nbytes=4 * len(shape)
        ).SerializeToString(),
        st.text(max_size=70),
        st.sampled_from(["float32", "", "bfloat16"]),
        st.lists(st.integers(0, 1 << 40), max_size=3),
    ),
)


@settings(max_examples=300, deadline=None)
@given(
    items=st.lists(_ITEM, max_size=12),
    tail=st.binary(max_size=8),
    total=st.integers(0, 1 << 20),
)
def test_the_split_from_the_bytes_or_the_heads_entries_is_the_reference_split(
    items: list[bytes], tail: bytes, total: int
) -> None:
    """`tensor_table.split` of a manifest's bytes, and of the entries its `ManifestHead`
    parsed (a group call's check, which parses each manifest once): on tables of
    well-formed, malformed and unsplittable entries, and on bytes that do not parse (a
    random tail), both give what the reference gives: the same key and names, or None."""
    table = b"".join(tensor_table._Items(tensors=[item]).SerializeToString() for item in items)
    for serialized in (table, table + tail):
        expected = _split_entry_by_entry(serialized, total)
        assert tensor_table.split(serialized, total) == expected
        head = raw_manifest.head(serialized)  # the entries as a group call's check has them
        if head is not None:
            assert tensor_table.split(serialized, total, head.tensors) == expected


@settings(max_examples=200, deadline=None)
@given(
    names=st.lists(
        st.one_of(
            st.sampled_from(
                ["a", "b", "", "__metadata__", "x" * 128, "x" * 1025, "é" * 63, "b\x00"]
            ),
            st.text(max_size=20),
        ),
        min_size=1,
        max_size=4,
    ),
    shift=st.integers(0, 1),
    nbytes=st.sampled_from([4096, 4000]),
)
def test_the_check_from_bytes_refuses_random_tables_as_the_message_check(
    names: list[str], shift: int, nbytes: int
) -> None:
    """Random names (empty, repeated, reserved, too long, multi-byte) on a layout that
    passed before or a broken one: the check from the bytes refuses exactly as the check
    of the message, with the same message, which names the tensor."""
    m = pb.Manifest(total_bytes=4096 * len(names) + 4096 * shift, chunk_size=4096)
    for at, name in enumerate(names):
        m.tensors.add(name=name, dtype="float32", shape=[1024], offset=4096 * at, nbytes=nbytes)
    m.chunk_xxh3[:] = [1] * (-(-m.total_bytes // 4096))
    refusal = _same_from_bytes(m)
    valid = [
        n
        for n in names
        if n and n not in RESERVED_TENSOR_NAMES and len(n.encode()) <= MAX_TENSOR_NAME_BYTES
    ]
    if refusal:
        assert "tensor" in refusal or "name" in refusal, refusal
    else:
        assert nbytes == 4096
        assert len(set(valid)) == len(names)
