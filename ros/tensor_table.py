"""A serialized manifest's tensor table checked with work done in C, for the manifest
validator (`ros.manifest_check`): a hub checks thousands of shard manifests of a few hundred
tensors each (a group publish of 4,096 shards is 819,200 entries), and reading each entry's
fields as Python attributes costs microseconds an entry, most of a shard's time on the hub.

The table's rules split in two, both decided from the manifest's bytes:

- Its layout: each entry's dtype, shape, nbytes, offset and placement, the offsets in order
  and the last end within `total_bytes`. That depends only on the table without its names
  and on `total_bytes`, and the shards of one model share it (every rank of a layer-sharded
  model, every layer of one rank). So `layout_key` is the table re-serialized without names
  (one protobuf parse and serialize of a view, in C), and a layout once checked passes on
  the table's bytes alone (`passed`, `remember`: a bounded LRU of exact keys; equal bytes
  parse to equal fields, so a key is never taken for another table).
- Its names: each one's serialization as a one-field message (`names`, two more views in
  C) is a prefix that says its length followed by the name, so the names are distinct
  exactly when these are, empty exactly when one is `b""`, and within a bound of bytes
  exactly when these are within that bound's item length: set, `in` and `max` in C
  (`names_pass`). A parsed proto3 string is valid UTF-8 already.

Both from one parse (`split`), for bytes as `SerializeToString` makes them: each entry's
name is its first field, written once (an empty name, a proto3 default, is not written, so
that entry starts with another field), followed by the entry's other fields. An entry's
bytes (`Items`, in C, or a `ManifestHead`'s entries where the caller parsed them) then
split at its name with a slice each: the names, and the rest of every entry with the
entries' lengths, which is the layout's key (`split`'s, told apart from `layout_key`'s by
its first byte; the lengths keep two entries from reading as one). That is one parse and a
loop of slices instead of four parses, two discards and two serializations (a 200-tensor
shard's check: about 100 us of CPU instead of 140 here). An entry whose name is not first,
or is 128 bytes or more (its length then takes two bytes), leaves `split` to the views
above.

The views are messages of their own descriptor pool, declared here (no change to the
wire's schema): `Layout` (TensorEntry's fields 2 to 7), `Name` (field 1) and `Items` (each
entry as bytes). Every field keeps TensorEntry's number and type, so each view parses the
bytes as `pb.Manifest` does.
"""

from __future__ import annotations

import functools
from array import array
from collections.abc import Collection, Sequence
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError

from tensorhub.lru import SizedLru

LAYOUT_CACHE_BYTES = 16 << 20  # the layouts remembered as checked, keys' bytes together

_F = descriptor_pb2.FieldDescriptorProto
_PACKAGE = "tensorhub.v1.tableviews"


def _views() -> dict[str, Any]:
    """The view messages (classes made at run time: `Any` to the type checker), from a
    descriptor pool of their own."""
    file = descriptor_pb2.FileDescriptorProto(
        name="tensorhub/v1/table_views.proto", package=_PACKAGE, syntax="proto3"
    )
    one, many = _F.LABEL_OPTIONAL, _F.LABEL_REPEATED
    declared: dict[str, list[tuple[str, int, int, int, str]]] = {
        "Entry": [
            ("dtype", 2, _F.TYPE_STRING, one, ""),
            ("shape", 3, _F.TYPE_INT64, many, ""),
            ("offset", 4, _F.TYPE_INT64, one, ""),
            ("nbytes", 5, _F.TYPE_INT64, one, ""),
            ("global_shape", 6, _F.TYPE_INT64, many, ""),
            ("global_offsets", 7, _F.TYPE_INT64, many, ""),
        ],
        "Layout": [("tensors", 1, _F.TYPE_MESSAGE, many, f".{_PACKAGE}.Entry")],
        "Name": [("name", 1, _F.TYPE_STRING, one, "")],
        "Names": [("tensors", 1, _F.TYPE_MESSAGE, many, f".{_PACKAGE}.Name")],
        "Items": [("tensors", 1, _F.TYPE_BYTES, many, "")],
    }
    for name, fields in declared.items():
        message = file.message_type.add(name=name)
        for field, number, kind, label, type_name in fields:
            added = message.field.add(name=field, number=number, type=kind, label=label)
            if type_name:
                added.type_name = type_name
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return {
        name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{_PACKAGE}.{name}"))
        for name in declared
    }


_VIEWS = _views()
_Layout, _Name, _Names, _Items = (_VIEWS[n] for n in ("Layout", "Name", "Names", "Items"))
_NAME_TAG = 0x0A  # field 1 (a tensor's name), length-delimited
_LONG = 0x80  # a name's length that takes more than one byte
_SPLIT_KEY = b"\x00"  # starts `split`'s keys; a serialized Layout starts with a tag, never 0
_layouts: SizedLru[tuple[bytes, int], int] = SizedLru(LAYOUT_CACHE_BYTES, lambda size: size)


def layout_key(serialized: bytes, total: int) -> tuple[bytes, int] | None:
    """The key of the tensor table's layout in `serialized` (a `pb.Manifest`) with
    `total_bytes` `total`: its entries without names, re-serialized. None if the bytes do
    not parse (the caller checks entry by entry instead)."""
    try:
        view = _Layout.FromString(serialized)
    except DecodeError:
        return None
    view.DiscardUnknownFields()  # the names, and every field not of the table's layout
    return view.SerializeToString(), total


def passed(key: tuple[bytes, int]) -> bool:
    """Whether the layout of `key` was checked and passed in this process."""
    return _layouts.get(key) is not None


def remember(key: tuple[bytes, int]) -> None:
    """Record that the layout of `key` passed (kept while the cache has room)."""
    _layouts.put(key, len(key[0]) + 1)


def split(
    serialized: bytes, total: int, entries: Sequence[bytes] | None = None
) -> tuple[tuple[bytes, int], list[bytes]] | None:
    """The key of the tensor table's layout in `serialized` (a `pb.Manifest` as
    `SerializeToString` makes it) with `total_bytes` `total`, and each tensor's name as its
    UTF-8 bytes, in order, from one parse (module docstring); None if the bytes do not
    parse or an entry does not start with its name of at most 127 bytes (the caller then
    uses `layout_key` and `names`). `entries`: the table's entries as bytes where the caller
    parsed them already (a `raw_manifest.ManifestHead`'s `tensors`), instead of a parse."""
    try:
        items = _Items.FromString(serialized).tensors if entries is None else entries
    except DecodeError:
        return None
    found: list[bytes] = []
    rests: list[bytes] = []
    for item in items:
        size = item[1] if len(item) > 1 and item[0] == _NAME_TAG else _LONG
        if size >= _LONG:
            return None
        found.append(item[2 : 2 + size])
        rests.append(item[2 + size :])
    lengths = array("I", map(len, rests))  # where each entry's rest ends
    head = _SPLIT_KEY + len(rests).to_bytes(4, "little")
    return (head + lengths.tobytes() + b"".join(rests), total), found


def raw_names_pass(found: Sequence[bytes], reserved: Collection[str], max_bytes: int) -> bool:
    """Whether every name `found` holds (UTF-8 bytes, from `split`) passes the name rules:
    none empty, none twice, none in `reserved`, each at most `max_bytes`."""
    if not found:
        return True
    distinct = set(found)
    if len(distinct) != len(found) or b"" in distinct:
        return False
    return distinct.isdisjoint(_encoded(frozenset(reserved))) and max(map(len, found)) <= max_bytes


@functools.cache
def _encoded(reserved: frozenset[str]) -> frozenset[bytes]:
    return frozenset(name.encode() for name in reserved)


def names(serialized: bytes) -> list[bytes] | None:
    """Each tensor's name in `serialized` (a `pb.Manifest`) as its one-field message's bytes,
    in order (`b""` for an empty name); None if the bytes do not parse."""
    try:
        view = _Names.FromString(serialized)
        view.DiscardUnknownFields()
        items: Sequence[bytes] = _Items.FromString(view.SerializeToString()).tensors
    except DecodeError:
        return None
    return list(items)


def names_pass(items: Sequence[bytes], reserved: Collection[str], max_bytes: int) -> bool:
    """Whether every name `items` (from `names`) holds passes the name rules: none empty,
    none twice, none in `reserved`, each at most `max_bytes` of UTF-8."""
    if not items:
        return True
    distinct = set(items)
    if len(distinct) != len(items) or b"" in distinct:
        return False
    refused, longest = _bounds(frozenset(reserved), max_bytes)
    return distinct.isdisjoint(refused) and max(map(len, items)) <= longest


@functools.cache
def _bounds(reserved: frozenset[str], max_bytes: int) -> tuple[frozenset[bytes], int]:
    """The items of the `reserved` names, and the longest item of a name within `max_bytes`
    (a tag, the length's varint, `max_bytes` bytes)."""
    refused = frozenset(_Name(name=name).SerializeToString() for name in reserved)
    return refused, len(_Name(name="x" * max_bytes).SerializeToString())
