"""The records of declared rollout layouts, as etcd stores them and the wire carries them:
their bounds, a declared block set's rows (`check_rows`), a layout's publisher checksums
(`encode_publisher_sums`), and a shard's parts of them (`Part`, `encode_parts`,
`add_parts`). Pure functions of bytes, shared by the SDK (which computes the parts), the
hub and `consistency.declared_layouts` (which keeps them in etcd), so that the SDK need not
load the etcd layer (docs/design-notes.md, "Publish-time checksums of declared layouts")."""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tensorhub.errors import InvalidArgument

MAX_DECLARED_LAYOUTS = 4
"""The most layouts one model may have declared: each costs every publish a pass over the
published bytes and a key per version (a rollout size or two, and one being replaced)."""

MAX_DECLARED_BLOCK_SETS = 64
"""The most block sets (distinct workers' blocks) one declared layout names: a TP-64 layout."""

MAX_DECLARED_BYTES = 512 * 1024
"""The longest value of a model's declarations (all its layouts' blocks)."""

MAX_PUBLISHER_SUMS = 1 << 16
"""The most chunk checksums one publish may carry for its declared layouts (512 KiB in
etcd); a publisher with more sends none (its readers take the reader-derived path)."""

MAX_PARTS_SHARDS = 4096
"""The most shards whose parts of the publisher's checksums a version records: every
version a hub takes (`consistency.manifests.MAX_SHARDS`). The ranks of a version with more
send none (the hub refuses parts from one, `InvalidArgument`), and its layout readers take
the reader-derived path."""

PARTS_PAGE = 64
"""Part keys a resolve reads at a time (one key a shard, at most `MAX_PARTS_BYTES` each: 16
MiB a page at most, under the etcd client's 64 MiB message bound). A resolve reads the
first page in its own transaction; a version of more shards has the others read page by
page, once: the hub keeps what a version's parts add up to (`consistency.parts_sums`)."""

MAX_PARTS_READ_BYTES = 64 * 1024 * 1024
"""The most bytes of parts a hub reads to add up one version's publisher checksums; a
version whose parts take more has no sums (logged): its readers take the reader-derived
path. Parts are about 30 bytes a chunk of a declared block set a shard touches, so a model
within `MAX_PUBLISHER_SUMS` chunks a layout stays far below it."""

MAX_PART_SUMS = 1 << 15
"""The most chunk checksums one shard's parts may carry (in all its parts)."""

MAX_PARTS_BYTES = 256 * 1024
"""The longest value of one shard's parts as written (`encode_parts`): with
`consistency.shard_entries.EXTRA_OP_BYTES`, 32 operations of its batch at most."""

_ID = 32  # a block set's id: 128 bits in hex (`ros.client.layouts.block_set`)
_HEAD = struct.Struct(">I")
_SUM = struct.Struct(">Q")


def check_rows(raw: bytes) -> list[list[object]]:
    """A declared block set's rows, checked: a JSON list of [name, dtype, global shape,
    offsets, shape], sorted by name without repeats, each box inside its global shape;
    `InvalidArgument` otherwise."""
    try:
        rows = json.loads(raw)
    except ValueError as exc:
        raise InvalidArgument(f"a declared block set is not JSON: {exc}") from exc
    if not isinstance(rows, list) or not rows:
        raise InvalidArgument("a declared block set is a non-empty list of blocks")
    names = []
    for row in rows:
        if not (isinstance(row, list) and len(row) == 5):
            raise InvalidArgument("a declared block is [name, dtype, global shape, offsets, shape]")
        name, dtype, glob, offsets, shape = row
        if not isinstance(name, str) or not name or len(name) > 1024:
            raise InvalidArgument("a declared block's name is a string of 1 to 1024 characters")
        if not isinstance(dtype, str) or not 0 < len(dtype) <= 32:
            raise InvalidArgument(f"block {name!r}: its dtype is a short string")
        dims = [glob, offsets, shape]
        if not all(isinstance(d, list) and len(d) == len(glob) <= 16 for d in dims) or not all(
            isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 62
            for d in dims
            for x in d
        ):
            raise InvalidArgument(f"block {name!r}: its shapes are lists of as many naturals")
        if any(o + s > g for o, s, g in zip(offsets, shape, glob, strict=True)):
            raise InvalidArgument(f"block {name!r}: its box lies outside its global shape")
        names.append(name)
    if names != sorted(set(names)):
        raise InvalidArgument("a declared block set's blocks are sorted by name, each once")
    return rows


@dataclass(frozen=True)
class Declared:
    """A model's declared layouts as read: each layout's block sets (their rows, as JSON
    bytes), and the key's mod revision (0: none declared)."""

    layouts: dict[str, list[bytes]]
    revision: int


def encode_declared(layouts: Mapping[str, Sequence[bytes]]) -> bytes:
    return json.dumps(
        {name: [rows.decode() for rows in sets] for name, sets in sorted(layouts.items())},
        separators=(",", ":"),
    ).encode()


def decode_declared(raw: bytes) -> dict[str, list[bytes]]:
    data = json.loads(raw)
    return {str(name): [str(rows).encode() for rows in sets] for name, sets in data.items()}


def encode_publisher_sums(sets: Mapping[str, Sequence[int]]) -> bytes:
    """One declared layout's publisher checksums: per block set, its id, count and sums."""
    out = bytearray()
    for block_set, sums in sorted(sets.items()):
        out += block_set.encode().ljust(_ID, b"\0")[:_ID] + _HEAD.pack(len(sums))
        out += b"".join(_SUM.pack(s) for s in sums)
    return bytes(out)


def decode_publisher_sums(raw: bytes, block_set: str) -> list[int]:
    """The publisher's checksums of `block_set` in a layout's key ([] if it names none)."""
    at = 0
    want = block_set.encode().ljust(_ID, b"\0")[:_ID]
    while at + _ID + _HEAD.size <= len(raw):
        name = raw[at : at + _ID]
        (n,) = _HEAD.unpack_from(raw, at + _ID)
        start = at + _ID + _HEAD.size
        end = start + n * _SUM.size
        if end > len(raw):
            raise InvalidArgument("malformed publisher checksums of a layout")
        if name == want:
            return [s for (s,) in _SUM.iter_unpack(raw[start:end])]
        at = end
    return []


@dataclass(frozen=True)
class Part:
    """One shard's part of a declared block set's chunk checksums: the wsum64 of each chunk
    in `chunks` with only the bytes of `tensor` in the rank's `box` (offsets, shape) in
    place and every other byte zero."""

    layout: str
    block_set: str
    tensor: str
    box: tuple[tuple[int, ...], tuple[int, ...]]
    chunks: tuple[int, ...]
    sums: tuple[int, ...]


def encode_parts(revision: int, count: int, parts: Sequence[Part]) -> bytes:
    """A shard's parts as written with its shard (`Keys.publisher_part`), with the
    declarations' revision its rank computed them for and the version's shard count."""
    rows = [
        [p.layout, p.block_set, p.tensor, list(p.box[0]), list(p.box[1]), list(p.chunks),
         [str(s) for s in p.sums]]
        for p in parts
    ]  # fmt: skip
    return json.dumps({"revision": revision, "count": count, "parts": rows}).encode()


def add_parts(values: Sequence[bytes], layout: str, block_set: str) -> list[int]:
    """The chunk checksums of `block_set` of `layout` from the shards' parts (`values`, one
    a shard), or [] unless every shard of the version wrote its parts, for one revision of
    the declarations: parts with the same tensor and box (replicas) count once, the others
    add up modulo 2**64. A chunk no part touches leaves them incomplete: []."""
    return add_all_parts(values).get((layout, block_set), [])


def add_all_parts(values: Sequence[bytes]) -> dict[tuple[str, str], list[int]]:
    """`add_parts` of every (layout, block set) the parts name, at once (one decode of each
    shard's parts); only block sets whose chunks are complete. Empty unless every shard of
    the version wrote its parts, all for one revision of the declarations."""
    decoded = [json.loads(v) for v in values]
    if not decoded or len({(d["revision"], d["count"]) for d in decoded}) != 1:
        return {}
    if len(decoded) != int(decoded[0]["count"]):
        return {}
    seen: set[tuple[str, str, str, str, str]] = set()
    added: dict[tuple[str, str], dict[int, int]] = {}
    for d in decoded:
        for lay, bs, tensor, offsets, shape, chunks, part in d["parts"]:
            key = (lay, bs, tensor, json.dumps(offsets), json.dumps(shape))
            if key in seen:  # a replica's part: counted once
                continue
            seen.add(key)
            sums = added.setdefault((str(lay), str(bs)), {})
            for chunk, value in zip(chunks, part, strict=True):
                sums[int(chunk)] = (sums.get(int(chunk), 0) + int(value)) % (1 << 64)
    return {
        at: [sums[i] for i in range(len(sums))]
        for at, sums in added.items()
        if sums and sorted(sums) == list(range(len(sums)))
    }
