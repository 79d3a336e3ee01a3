"""The one manifest validator: the hub runs it before any write, the SDK before it publishes
and on every manifest it receives (so a bad record already in etcd fails with a named error).

A manifest the hub accepts is one every reader can use. Without this check the hub would
write whatever a client sent and move `latest` to it, and readers would fail only at fetch:
an unknown dtype, overlapping offsets, a chunk size of 0, a checksum count that does not
match the chunk count, duplicate names, an offset past `total_bytes`, `nbytes` that is not
dtype x shape. The rules are those of `transport.layout.Layout` (which the SDK builds from a
manifest), restated here without torch so that the hub, which never imports torch, runs the
very same checks; `tests/ros/test_manifest_check.py` holds the two to each other.

Also here, as they bound what a client may make the hub write: manifest metadata
(`check_metadata`, which also holds the files a version carries for `tensorhub fetch` to
the allow-list `CARRIED_FILES`) and a holder's topology labels (`check_topology`). Every
bound is a module constant, documented in docs/hub.md ("Validation") and docs/security.md.
Every refusal is `InvalidManifest` (an `InvalidArgument`): nothing was written.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping, Sequence
from typing import Any

from google.protobuf.message import DecodeError

from ros import raw_manifest, tensor_table
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from tensorhub.checksum_kinds import KINDS, LINEAR
from tensorhub.delta_rules import ENCODINGS as DELTA_ENCODINGS
from tensorhub.delta_rules import WHOLE_RATIO, companion_of
from tensorhub.errors import InvalidArgument, InvalidManifest
from tensorhub.names import MAX_VERSION

# The flat-space rules of `transport.layout` (equal there: checked by the tests).
ALIGN = 64  # every tensor starts on a multiple of this
MIN_CHUNK = 4096  # chunk_size bounds, inclusive; chunk_size is a multiple of ALIGN
MAX_CHUNK = 1 << 30

MAX_VERSION_BYTES = 1 << 50  # 1 PiB: a version's flat space (whole, or one shard's)
MAX_TENSOR_NAME_BYTES = 1024  # a tensor name, UTF-8
# The key of a safetensors header's own metadata: no file can hold a tensor of this name, so
# a version with one could be fetched but never loaded from disk.
RESERVED_TENSOR_NAMES = frozenset({"__metadata__"})
MAX_DIMS = 64  # dimensions of one tensor (torch's own limit is 64 too)

MAX_METADATA_ENTRIES = 64  # manifest metadata: entries
MAX_METADATA_KEY_BYTES = 256  # one key, UTF-8
MAX_METADATA_BYTES = 64 << 10  # every key and value together, UTF-8

# A metadata entry `tensorhub.file:NAME` carries the file NAME for `tensorhub fetch` to
# write beside the weights (`ros.cli.carry`). NAME must be one of these, in this order of
# priority: the files that make a directory loadable by `from_pretrained` without code of
# the publisher's. Weights, indexes, `tensorhub.json`, paths and anything else are refused,
# so no publisher can make a fetch write a file of its choosing.
CARRIED_FILE_KEY = "tensorhub.file:"
CARRIED_FILES = (
    "config.json", "generation_config.json", "tokenizer_config.json",
    "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
    "chat_template.json", "preprocessor_config.json", "tokenizer.json", "tokenizer.model",
    "vocab.json", "vocab.txt", "merges.txt", "spiece.model", "sentencepiece.bpe.model",
)  # fmt: skip

MAX_TOPOLOGY_LABELS = 16  # labels of one holder (dc, rack, host and a few more)
MAX_LABEL_KEY_BYTES = 63
MAX_LABEL_VALUE_BYTES = 253  # a DNS name's length: a host label fits

# Element size of every dtype a manifest may name (torch's canonical spelling, which
# `transport.layout.dtype_name` writes). The hub must not import torch; the tests check
# this table against torch's dtypes.
DTYPE_SIZES: Mapping[str, int] = {
    **dict.fromkeys(
        ("bool", "uint8", "int8", "quint8", "qint8", "quint4x2", "quint2x4", "bits8",
         "bits1x8", "bits2x4", "bits4x2", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2",
         "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2", "uint1", "uint2", "uint3",
         "uint4", "uint5", "uint6", "uint7", "int1", "int2", "int3", "int4", "int5", "int6",
         "int7"),
        1,
    ),
    **dict.fromkeys(("float16", "bfloat16", "int16", "uint16", "bits16"), 2),
    **dict.fromkeys(("float32", "int32", "uint32", "qint32", "complex32"), 4),
    **dict.fromkeys(("float64", "int64", "uint64", "complex64"), 8),
    "complex128": 16,
}  # fmt: skip


def check_manifest(
    manifest: pb.Manifest,
    what: str = "manifest",
    *,
    model: str | None = None,
    version: int | None = None,
    serialized: bytes | None = None,
) -> None:
    """Raise `InvalidManifest` naming the first rule `manifest` breaks (`what` names it in
    the message: "manifest of shard 3"); return if every reader can use it. With `model`
    and `version` (the publish's), a delta section is checked against them too. With
    `serialized` (`manifest.SerializeToString()`, which a hub has made anyway), its tensor
    table is checked from those bytes (`ros.tensor_table`: the same rules, the same
    refusals, with work in C)."""
    try:
        _check_manifest(manifest, serialized)
        if manifest.HasField("delta"):
            _check_delta(manifest, model, version)
    except InvalidManifest as exc:
        raise InvalidManifest(f"{what}: {exc}") from None


def check_manifest_bytes(
    serialized: bytes,
    what: str = "manifest",
    *,
    model: str | None = None,
    version: int | None = None,
) -> None:
    """`check_manifest` of the manifest `serialized` holds, as the bytes came (a hub's
    `PublishShards` does not parse its shards' manifests whole: `ros.raw_manifest`): the
    same rules, the same refusals. Its fields other than the tensors are read from a
    `ManifestHead`, and its tensor table from the entries' bytes where its layout passed
    before (`ros.tensor_table`); anything else is decided on the manifest parsed whole,
    as `check_manifest` decides it. Bytes that do not parse as a `Manifest` are refused."""
    parsed = raw_manifest.head(serialized)
    if parsed is not None and _known_table_passes(parsed, serialized):
        try:
            _check_head(parsed)
            check_metadata(parsed.metadata, "metadata")
            if parsed.HasField("delta"):
                _check_delta(parsed, model, version)
        except InvalidManifest as exc:
            raise InvalidManifest(f"{what}: {exc}") from None
        return
    try:
        manifest = pb.Manifest.FromString(serialized)
    except DecodeError as exc:
        raise InvalidManifest(f"{what}: does not parse as a Manifest ({exc})") from None
    check_manifest(manifest, what, model=model, version=version, serialized=serialized)


def _known_table_passes(parsed: Any, serialized: bytes) -> bool:
    """Whether the tensor table of `serialized` (whose `ManifestHead` is `parsed`: its
    entries as bytes, read by `tensor_table.split` without a parse of its own) has a
    layout that passed before and names that pass, valid UTF-8 each (a `ManifestHead`
    reads the entries as bytes, so nothing checked them). False sends the manifest to the
    whole check, which names the rule broken, if any."""
    parts = tensor_table.split(serialized, parsed.total_bytes, parsed.tensors)  # parsed once
    if parts is None or not tensor_table.passed(parts[0]):
        return False
    found = parts[1]
    if not tensor_table.raw_names_pass(found, RESERVED_TENSOR_NAMES, MAX_TENSOR_NAME_BYTES):
        return False
    try:  # a NUL after each name: a sequence cut at a name's end cannot pass
        b"\x00".join(found).decode()
    except UnicodeDecodeError:
        return False
    return True


def _check_manifest(manifest: pb.Manifest, serialized: bytes | None) -> None:
    _check_head(manifest)
    if not _table_passes(manifest, serialized):
        _walk_tensors(manifest.tensors, manifest.total_bytes)  # a rule is broken: name it
    check_metadata(manifest.metadata, "metadata")


def _check_head(manifest: pb.Manifest) -> None:
    """The rules of the manifest's fields other than its tensor table and metadata: a
    tensor at all, the chunk size, the total, the checksum kind and count."""
    if not manifest.tensors:
        raise InvalidManifest("lists no tensors")
    size, total = manifest.chunk_size, manifest.total_bytes
    if not MIN_CHUNK <= size <= MAX_CHUNK or size % ALIGN:
        raise InvalidManifest(
            f"chunk_size {size} must be a multiple of {ALIGN} between {MIN_CHUNK} and {MAX_CHUNK}"
        )
    if not 0 <= total <= MAX_VERSION_BYTES:
        raise InvalidManifest(f"total_bytes {total} must be between 0 and {MAX_VERSION_BYTES}")
    if manifest.checksum not in ("", *KINDS):
        raise InvalidManifest(
            f"unknown chunk checksum {manifest.checksum!r} (known: {', '.join(KINDS)})"
        )
    chunks = (total + size - 1) // size
    if len(manifest.chunk_xxh3) != chunks:
        raise InvalidManifest(
            f"has {len(manifest.chunk_xxh3)} checksums for {chunks} chunks "
            f"({total} bytes in chunks of {size})"
        )


def _walk_tensors(tensors: Sequence[pb.TensorEntry], total: int) -> None:
    """`InvalidManifest` naming the first rule a tensor entry breaks, in order: each entry
    on its own (`_check_entry`), then its offset against the entry before it and the end."""
    names: set[str] = set()
    end = 0
    for entry in tensors:
        _check_entry(entry, names)
        if entry.offset < end:
            raise InvalidManifest(
                f"tensor {entry.name!r} at offset {entry.offset} overlaps the tensor before it "
                f"(which ends at {end}; tensors are listed in offset order)"
            )
        end = entry.offset + entry.nbytes
        if end > total:
            raise InvalidManifest(
                f"tensor {entry.name!r} ends at byte {end}, past total_bytes {total}"
            )


def _table_passes(manifest: pb.Manifest, serialized: bytes | None) -> bool:
    """Whether every tensor entry passes every rule `_walk_tensors` applies: from the
    manifest's bytes where given (its names in bulk, its layout once per distinct layout:
    `ros.tensor_table`), else by `_tensors_pass`. Never True when the walk would refuse."""
    total = manifest.total_bytes
    if serialized is None:
        return _tensors_pass(manifest.tensors, total)
    parts = tensor_table.split(serialized, total)
    if parts is not None and tensor_table.passed(parts[0]):  # the layout and names, one parse
        return tensor_table.raw_names_pass(parts[1], RESERVED_TENSOR_NAMES, MAX_TENSOR_NAME_BYTES)
    key = tensor_table.layout_key(serialized, total)
    if key is None or not tensor_table.passed(key):
        if not _tensors_pass(manifest.tensors, total):
            return False
        for passed in (key, None if parts is None else parts[0]):
            if passed is not None:  # the names passed too, and the layout is theirs alone
                tensor_table.remember(passed)
        return True
    if parts is not None:  # the same layout, under its one-parse key
        tensor_table.remember(parts[0])
    items = tensor_table.names(serialized)
    return items is not None and tensor_table.names_pass(
        items, RESERVED_TENSOR_NAMES, MAX_TENSOR_NAME_BYTES
    )


def _tensors_pass(tensors: Sequence[pb.TensorEntry], total: int) -> bool:
    """Whether every tensor entry passes every rule `_walk_tensors` applies, decided in
    bulk: the same rules, with less Python per entry (a version of 4,096 shards of 200
    tensors is 819,200 entries). False when any rule fails (the caller then walks the
    entries one by one to name the first); never True when one would. Placement of a
    model-parallel block: `_placement_fits`."""
    sizes = DTYPE_SIZES
    prod = math.prod
    names: list[str] = []
    end = 0
    for name, dtype, offset, nbytes, dims, glob, offsets in map(_FIELDS, tensors):
        shape = dims[:]  # a list: cheaper to walk twice than the message's container
        itemsize = sizes.get(dtype)
        if (
            itemsize is None
            or offset < end
            or offset % ALIGN
            or len(shape) > MAX_DIMS
            or (shape and min(shape) < 0)
            or nbytes != prod(shape) * itemsize
            or ((glob or offsets) and not _placement_fits(shape, glob, offsets))
        ):
            return False
        end = offset + nbytes  # offsets only grow, and so do the ends: the last is the end
        names.append(name)
    if end > total or len(set(names)) != len(names) or not RESERVED_TENSOR_NAMES.isdisjoint(names):
        return False
    if not names:
        return True  # (a manifest without tensors is refused before: not a tensor's rule)
    if min(map(len, names)) < 1:
        return False
    try:
        "".join(names).encode()  # every name encodes (UTF-8)
    except UnicodeEncodeError:
        return False
    # a name of n characters is n to 4n bytes: only a long one needs its bytes counted
    longest = max(map(len, names))
    return longest * 4 <= MAX_TENSOR_NAME_BYTES or all(
        len(n.encode()) <= MAX_TENSOR_NAME_BYTES for n in names
    )


_FIELDS = operator.attrgetter(
    "name", "dtype", "offset", "nbytes", "shape", "global_shape", "global_offsets"
)


def _placement_fits(shape: Sequence[int], glob: Sequence[int], offsets: Sequence[int]) -> bool:
    """`_check_placement`'s rule as a test: one entry per dimension in both lists, and the
    block inside the global tensor."""
    if len(glob) != len(shape) or len(offsets) != len(shape):
        return False
    return all(start >= 0 and start + dim <= size
               for dim, size, start in zip(shape, glob, offsets, strict=True))  # fmt: skip


def _check_delta(manifest: pb.Manifest, model: str | None, version: int | None) -> None:
    """A delta section every reader can use: a base before this version, a known encoding,
    one size, digest and base checksum per chunk, each size at most `WHOLE_RATIO` of a chunk
    (a larger one goes whole, size 0), under a linear checksum one xxh3-64 of each result
    chunk (`result_xxh3`; none otherwise), and the companion model that serves them."""
    delta = manifest.delta
    if not 1 <= delta.base <= MAX_VERSION or (version is not None and delta.base >= version):
        raise InvalidManifest(
            f"delta base {delta.base} must be a version before this one ({version})"
        )
    if delta.encoding not in DELTA_ENCODINGS:
        raise InvalidManifest(
            f"unknown delta encoding {delta.encoding[:40]!r} (known: {', '.join(DELTA_ENCODINGS)})"
        )
    chunks = len(manifest.chunk_xxh3)
    counts = (len(delta.encoded_bytes), len(delta.encoded_xxh3), len(delta.base_checksum))
    if counts != (chunks,) * 3:
        raise InvalidManifest(
            f"delta lists {counts[0]} sizes, {counts[1]} digests and {counts[2]} base "
            f"checksums for {chunks} chunks"
        )
    results = len(delta.result_xxh3)
    if manifest.checksum in LINEAR and results != chunks:
        raise InvalidManifest(
            f"a delta of a {manifest.checksum} version lists the xxh3-64 of every chunk it "
            f"makes (a linear checksum alone cannot tell two results apart): {results} for "
            f"{chunks} chunks"
        )
    if manifest.checksum not in LINEAR and results:
        raise InvalidManifest("result digests belong to the delta of a wsum64 version only")
    bound = int(WHOLE_RATIO * manifest.chunk_size)
    for index, size in enumerate(delta.encoded_bytes):
        if not 0 <= size <= bound:
            raise InvalidManifest(
                f"delta chunk {index}: {size} encoded bytes (0 to {bound}: a chunk whose "
                f"encoding is over {WHOLE_RATIO} of it goes whole)"
            )
        if size == 0 and delta.encoded_xxh3[index]:
            raise InvalidManifest(f"delta chunk {index} is sent whole but has a digest")
    if not any(delta.encoded_bytes):
        raise InvalidManifest("delta encodes no chunk (publish without one)")
    if model is not None and delta.companion != companion_of(model):
        raise InvalidManifest(
            f"delta companion {delta.companion[:70]!r}: the deltas of {model!r} are served "
            f"as {companion_of(model)!r}"
        )


def check_tensor_name(name: str) -> None:
    """`InvalidManifest` for a tensor name no reader can use: empty, over
    `MAX_TENSOR_NAME_BYTES` of UTF-8 (or not encodable), or in `RESERVED_TENSOR_NAMES`."""
    try:
        size = len(name.encode())
    except UnicodeEncodeError:
        raise InvalidManifest(f"tensor name {name[:40]!r} is not valid UTF-8") from None
    if not name or size > MAX_TENSOR_NAME_BYTES:
        raise InvalidManifest(
            f"tensor name {name[:40]!r} must be 1 to {MAX_TENSOR_NAME_BYTES} bytes"
        )
    if name in RESERVED_TENSOR_NAMES:
        raise InvalidManifest(
            f"tensor name {name!r} is reserved: a safetensors header keeps its own metadata "
            "under it, so no file could hold the tensor"
        )


def _check_entry(entry: pb.TensorEntry, names: set[str]) -> None:
    """One tensor entry on its own: name, dtype, shape, nbytes, offset, placement."""
    name = entry.name
    check_tensor_name(name)
    if name in names:
        raise InvalidManifest(f"duplicate tensor name {name!r}")
    names.add(name)
    itemsize = DTYPE_SIZES.get(entry.dtype)
    if itemsize is None:
        raise InvalidManifest(f"tensor {name!r}: unknown dtype {entry.dtype[:40]!r}")
    shape = entry.shape
    if len(shape) > MAX_DIMS:
        raise InvalidManifest(f"tensor {name!r} has {len(shape)} dimensions (at most {MAX_DIMS})")
    count = 1
    for dim in shape:
        if dim < 0:
            raise InvalidManifest(f"tensor {name!r}: negative dimension in shape {list(shape)}")
        count *= dim
    if entry.nbytes != count * itemsize:
        raise InvalidManifest(
            f"tensor {name!r}: nbytes {entry.nbytes} is not {entry.dtype} x {list(shape)} "
            f"= {count * itemsize}"
        )
    if entry.offset < 0 or entry.offset % ALIGN:
        raise InvalidManifest(
            f"tensor {name!r}: offset {entry.offset} is negative or not a multiple of {ALIGN}"
        )
    _check_placement(name, shape, entry.global_shape, entry.global_offsets)


def _check_placement(
    name: str, shape: Sequence[int], glob: Sequence[int], offsets: Sequence[int]
) -> None:
    """A model-parallel block: both lists empty (a whole tensor), or one entry per
    dimension each, the block inside the global tensor."""
    if not glob and not offsets:
        return
    if len(glob) != len(shape) or len(offsets) != len(shape):
        raise InvalidManifest(
            f"tensor {name!r}: global_shape {list(glob)} and global_offsets {list(offsets)} "
            f"need one entry per dimension of its shape {list(shape)}"
        )
    for dim, size, start in zip(shape, glob, offsets, strict=True):
        if start < 0 or start + dim > size:
            raise InvalidManifest(
                f"tensor {name!r} of shape {list(shape)} at offsets {list(offsets)} does not "
                f"fit in its global shape {list(glob)}"
            )


def check_metadata(metadata: Mapping[str, str], what: str = "manifest metadata") -> None:
    """`InvalidManifest` past `MAX_METADATA_ENTRIES` entries, a key over
    `MAX_METADATA_KEY_BYTES` or `MAX_METADATA_BYTES` of keys and values together, or a
    carried file (`CARRIED_FILE_KEY` + NAME) whose NAME is not in `CARRIED_FILES`."""
    if len(metadata) > MAX_METADATA_ENTRIES:
        raise InvalidManifest(
            f"{what} has {len(metadata)} entries (at most {MAX_METADATA_ENTRIES})"
        )
    total = 0
    for key, value in metadata.items():
        key_bytes = len(key.encode())
        if not key or key_bytes > MAX_METADATA_KEY_BYTES:
            raise InvalidManifest(
                f"{what} key {key[:40]!r} must be 1 to {MAX_METADATA_KEY_BYTES} bytes"
            )
        if key.startswith(CARRIED_FILE_KEY) and key[len(CARRIED_FILE_KEY) :] not in CARRIED_FILES:
            raise InvalidManifest(
                f"{what} key {key[:80]!r}: a version carries only the files "
                f"{', '.join(CARRIED_FILES)}"
            )
        total += key_bytes + len(value.encode())
        if total > MAX_METADATA_BYTES:
            raise InvalidManifest(f"{what} exceeds {MAX_METADATA_BYTES} bytes (keys and values)")


def check_topology(labels: Mapping[str, str], what: str = "topology") -> None:
    """`InvalidArgument` past `MAX_TOPOLOGY_LABELS` labels, an empty key, a key over
    `MAX_LABEL_KEY_BYTES` or a value over `MAX_LABEL_VALUE_BYTES` (holder records carry
    them into etcd and into every Resolve answer)."""
    if len(labels) > MAX_TOPOLOGY_LABELS:
        raise InvalidArgument(f"{what} has {len(labels)} labels (at most {MAX_TOPOLOGY_LABELS})")
    for key, value in labels.items():
        if not key or len(key.encode()) > MAX_LABEL_KEY_BYTES:
            raise InvalidArgument(
                f"{what} label {key[:40]!r} must be 1 to {MAX_LABEL_KEY_BYTES} bytes"
            )
        if len(value.encode()) > MAX_LABEL_VALUE_BYTES:
            raise InvalidArgument(
                f"{what} label {key!r} is {len(value.encode())} bytes "
                f"(at most {MAX_LABEL_VALUE_BYTES})"
            )


def check_received(answer: pb.ResolveResponse, what: str) -> None:
    """A reader's check of the manifest(s) a Resolve answered (one per shard of a
    model-parallel version asked whole), before it lays out or allocates anything: a bad
    record already in etcd (written before the hub validated, or by hand) fails with
    `InvalidManifest` naming the version, never deep inside a fetch."""
    if answer.shards:
        for index, shard in enumerate(answer.shards):
            check_manifest(shard, f"manifest of shard {index} of {what}")
    else:
        check_manifest(answer.manifest, f"manifest of {what}")
