"""A layout block set's records: which blocks (`BlockSetKey`), the value of its key (its
description and chunk checksums: `encode_block_set`, `decode_block_set`), and what a Resolve
or a cover of it finds (`LayoutHolders`, `CoverSet`).

Apart from the registry's etcd requests (`consistency.layouts`) and its bounds
(`consistency.layout_limits`): the bytes a block set's key holds and the values the registry
takes and answers, with no etcd in them; the hub's budget sizes its largest write from
`MAX_BLOCK_SET_BYTES` without the registry.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

from consistency.layout_limits import MAX_BLOCK_SUMS, MAX_BLOCKS_BYTES
from consistency.records import HolderRecord
from tensorhub.errors import InvalidArgument

_SUM = struct.Struct(">Q")
_LEN = struct.Struct(">I")

MAX_BLOCK_SET_BYTES = _LEN.size + MAX_BLOCKS_BYTES + _SUM.size * MAX_BLOCK_SUMS
"""The longest value of a block set's key (about 768 KiB)."""


def encode_sums(sums: list[int]) -> bytes:
    return b"".join(_SUM.pack(s) for s in sums)


def decode_sums(raw: bytes) -> list[int]:
    if len(raw) % _SUM.size:
        raise InvalidArgument("malformed layout block checksums")
    return [s for (s,) in _SUM.iter_unpack(raw)]


def encode_block_set(blocks: bytes, sums: list[int]) -> bytes:
    """A block set's key: its description's length, the description, then its checksums."""
    return _LEN.pack(len(blocks)) + blocks + encode_sums(sums)


def decode_block_set(raw: bytes) -> tuple[bytes, list[int]]:
    """(description, checksums) of a block set's key."""
    if len(raw) < _LEN.size:
        raise InvalidArgument("malformed layout block set record")
    (n,) = _LEN.unpack_from(raw)
    end = _LEN.size + n
    if end > len(raw):
        raise InvalidArgument("malformed layout block set record")
    return raw[_LEN.size : end], decode_sums(raw[end:])


@dataclass(frozen=True)
class BlockSetKey:
    """Which blocks: model@version, the layout's name, and the block set's id."""

    tenant: str
    model: str
    version: int
    layout: str
    block_set: str


@dataclass(frozen=True)
class CoverSet:
    """One block set of a layout, for a reader it may cover: its id, description,
    checksums and a few of its holders."""

    block_set: str
    blocks: bytes
    sums: list[int]
    holders: list[HolderRecord]
    publisher_sums: list[int] = field(default_factory=list)  # declared before the publish


@dataclass(frozen=True)
class LayoutHolders:
    """What a Resolve of a block set finds: its holders (at most the range's limit), their
    recorded checksums (empty: none yet), the revision it read at, and the publisher's
    checksums of the block set (`consistency.declared_layouts`; empty: its layout was not
    declared before the version's publish)."""

    holders: list[HolderRecord]
    sums: list[int]
    revision: int
    publisher_sums: list[int] = field(default_factory=list)  # declared before the publish
