"""Declared rollout layouts and the publisher's checksums of their block sets
(docs/design-notes.md, "Publish-time checksums of declared layouts").

A rollout declares its layout for a model before the trainer publishes (`Hub.declare_layout`):
per worker, its blocks (name, dtype, global shape, offsets, shape of each). All of a model's
declarations are one key, `{tenant}/lb/{model}/declared` (beside its versions' layout keys,
so `DeleteModel` deletes it with them), changed only by a compare on its mod revision, so the
bounds hold exactly under races: at most `MAX_DECLARED_LAYOUTS` layouts a model (past it:
`TooManyDeclaredLayouts`), `MAX_DECLARED_BLOCK_SETS` block sets a layout, and
`MAX_DECLARED_BYTES` in all. `RetireLayout` deletes one layout from it.

A whole publish carries the mod revision of the declarations its publisher read and, per
declared block set, the wsum64 of every chunk of the block set's layout (`LayoutSums`). Its
transaction compares that revision (a declaration or retirement since: `LayoutsChanged`,
nothing written) and writes one key per declared layout,
`{tenant}/lb/{model}/{version:020d}/{layout}/p`, with the sums of its block sets: the
version and its publisher checksums appear in one commit, and retention deletes them with
it. A reader of a block set reads its sums from that key (`decode_publisher_sums`).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from consistency import ops
from consistency.etcd import Etcd
from consistency.keys import Keys
from consistency.retry import CAS_POLICY, LostRace
from tensorhub.errors import (
    DeadlineExceeded,
    InvalidArgument,
    LayoutsChanged,
    TooManyDeclaredLayouts,
    VersionNotFound,
)
from tensorhub.names import validate_name

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

MAX_PARTS_SHARDS = 64
"""The most shards whose parts of the publisher's checksums a version records (a reader's
resolve reads one key a shard, so it stays bounded); the ranks of a version with more send
none, and its layout readers take the reader-derived path."""

MAX_PART_SUMS = 1 << 15
"""The most chunk checksums one shard's parts may carry (in all its parts)."""

MAX_PARTS_BYTES = 256 * 1024
"""The longest value of one shard's parts as written (`encode_parts`): with
`consistency.shard_commit.EXTRA_OP_BYTES`, 32 operations of its batch at most."""

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
    decoded = [json.loads(v) for v in values]
    if not decoded or len({(d["revision"], d["count"]) for d in decoded}) != 1:
        return []
    if len(decoded) != int(decoded[0]["count"]):
        return []
    seen: set[tuple[str, str, str]] = set()
    sums: dict[int, int] = {}
    for d in decoded:
        for lay, bs, tensor, offsets, shape, chunks, part in d["parts"]:
            if (lay, bs) != (layout, block_set):
                continue
            key = (tensor, json.dumps(offsets), json.dumps(shape))
            if key in seen:
                continue
            seen.add(key)
            for chunk, value in zip(chunks, part, strict=True):
                sums[int(chunk)] = (sums.get(int(chunk), 0) + int(value)) % (1 << 64)
    if not sums or sorted(sums) != list(range(len(sums))):
        return []
    return [sums[i] for i in range(len(sums))]


class DeclaredLayouts:
    """Declare, retire and read a tenant's models' declared layouts; what a whole publish
    adds to its transaction for them (`publish_ops`)."""

    def __init__(self, etcd: Etcd, keys: Keys) -> None:
        self.etcd = etcd
        self.keys = keys

    def read(self, tenant: str, model: str, *, timeout: float | None = None) -> Declared:
        kv, _ = self.etcd.get(self.keys.declared_layouts(tenant, model), timeout=timeout)
        if kv is None:
            return Declared({}, 0)
        return Declared(decode_declared(bytes(kv.value)), int(kv.mod_revision))

    def declare(
        self,
        tenant: str,
        model: str,
        layout: str,
        block_sets: Sequence[bytes],
        *,
        timeout: float = 10.0,
    ) -> int:
        """Declare (or replace) `layout` of `model` with `block_sets` (each `check_rows`'),
        the model existing; the commit revision. `TooManyDeclaredLayouts` past
        `MAX_DECLARED_LAYOUTS`, `InvalidArgument` past the other bounds, `VersionNotFound`
        for a model never published."""
        validate_name(layout, "layout")
        if not block_sets:
            raise InvalidArgument("a declared layout names at least one block set")
        unique = sorted(set(block_sets))
        if len(unique) > MAX_DECLARED_BLOCK_SETS:
            raise InvalidArgument(
                f"{len(unique)} block sets in layout {layout!r}: at most {MAX_DECLARED_BLOCK_SETS}"
            )
        for rows in unique:
            check_rows(rows)

        def change(layouts: dict[str, list[bytes]]) -> dict[str, list[bytes]]:
            if layout not in layouts and len(layouts) >= MAX_DECLARED_LAYOUTS:
                raise TooManyDeclaredLayouts(
                    f"{model} has {MAX_DECLARED_LAYOUTS} declared layouts "
                    f"({', '.join(sorted(layouts))}): retire one before declaring {layout!r}"
                )
            return {**layouts, layout: unique}

        return self._change(tenant, model, change, timeout)

    def retire(self, tenant: str, model: str, layout: str, *, timeout: float = 10.0) -> int:
        """Retire `layout` of `model` (versions published from now on carry no checksums
        for it; those already published keep theirs); the commit revision, 0 if it was not
        declared."""
        validate_name(layout, "layout")
        found = self.read(tenant, model, timeout=timeout)
        if layout not in found.layouts:
            return 0
        return self._change(
            tenant, model, lambda ls: {k: v for k, v in ls.items() if k != layout}, timeout
        )

    def _change(
        self,
        tenant: str,
        model: str,
        change: Callable[[dict[str, list[bytes]]], dict[str, list[bytes]]],
        timeout: float,
    ) -> int:
        key = self.keys.declared_layouts(tenant, model)
        latest = self.keys.latest(tenant, model)
        deadline = CAS_POLICY.deadline(timeout)

        def attempt() -> int:
            read = self.etcd.txn(
                [], [ops.get(key), ops.get(latest, count_only=True)], timeout=timeout
            )
            if not int(read.responses[1].response_range.count):
                raise VersionNotFound(f"model {model!r} has no version: publish it first")
            kvs = read.responses[0].response_range.kvs
            seen = int(kvs[0].mod_revision) if kvs else 0
            now = change(decode_declared(bytes(kvs[0].value)) if kvs else {})
            value = encode_declared(now)
            if len(value) > MAX_DECLARED_BYTES:
                raise InvalidArgument(
                    f"{model}'s declared layouts would take {len(value)} bytes: at most "
                    f"{MAX_DECLARED_BYTES}"
                )
            write = ops.put(key, value) if now else ops.delete(key)
            result = self.etcd.txn([ops.mod(key, "==", seen)], [write], timeout=timeout)
            if not result.succeeded:
                raise LostRace(f"{model}'s declared layouts changed meanwhile")
            return int(result.revision)

        return CAS_POLICY.compare_and_set(
            attempt,
            deadline,
            lambda: DeadlineExceeded(f"{model}'s declared layouts kept changing"),
        )

    def publish_ops(
        self,
        tenant: str,
        model: str,
        version: int,
        seen: int,
        sums: Mapping[str, Mapping[str, Sequence[int]]],
        *,
        timeout: float | None = None,
    ) -> tuple[Callable[[float], list[ops.Cmp]], list[ops.Op]]:
        """What a whole publish adds to its transaction: a compare of the declarations' mod
        revision with `seen` (the one the publisher computed `sums` for: per layout, per
        block set, its chunks' wsum64), asked before each attempt, and one put per layout
        of `sums`. The first attempt only compares; a later one (the compare may have
        failed it) reads the key first and refuses with `LayoutsChanged` if it moved."""
        key = self.keys.declared_layouts(tenant, model)
        puts = [
            ops.put(self.keys.publisher_sums(tenant, model, version, layout),
                    encode_publisher_sums(sets))
            for layout, sets in sorted(sums.items())
        ]  # fmt: skip
        tries = [0]

        def agree(remaining: float) -> list[ops.Cmp]:
            tries[0] += 1
            if tries[0] > 1:
                kv, _ = self.etcd.get(key, timeout=remaining)
                now = int(kv.mod_revision) if kv is not None else 0
                if now != seen:
                    raise LayoutsChanged(
                        f"{model}'s declared layouts changed (revision {now}, the publisher "
                        f"read {seen}): read them again and publish again"
                    )
            return [ops.mod(key, "==", seen)]

        return agree, puts
