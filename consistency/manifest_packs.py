"""Packs: the manifests of one shard batch, compressed, in one etcd value of that batch.

A process group's version (`PublishShards`) carries thousands of shard manifests of a
transformer layer's worth of tensors each (200 tensors: about 12 KB). Paged one by one
(`consistency.manifests`), each would cost its own transaction before its batch: 4,096
shards, 4,096 more revisions, and 4,096 more round trips. Here a shard's manifest of at
most `SHARD_PACK_BYTES` is compressed (zstd) when it is staged, nothing is written, and the
batch that commits the shard (`consistency.shard_commit`) writes the compressed manifests of
all its packed shards as one value, the pack, in its own transaction, next to their shard
records. Each shard record's header names the pack (a random id per transaction), the
offset and the stored length of its manifest, and keeps the size and SHA-256 of the
manifest itself, so readers check exactly what they check of a paged or inline manifest.

Why this holds the publish's guarantees: the pack is written only by the transaction that
writes the records naming it, so it is durable exactly when they are (nothing to stage under
a lease, nothing orphaned by a lost race or a refused shard, nothing to discard), and a
reader never sees a record whose manifest is missing. A pack is never rewritten: retention
deletes it with the version's `mp/` prefix.

Bounds, within etcd's defaults (`--max-request-bytes` 1.5 MiB, `--max-txn-ops` 128): a
batch's packed bytes stay within `PACK_BYTES` (1 MiB, the size of a page), so its request
stays under 1.5 MiB with its records; a pack is one operation of the batch. A manifest of
200 tensors compresses to about 700 bytes, so 61 shards (a full batch) take about 40 KB.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Sequence

import zstandard

from consistency.records import PartHeader
from tensorhub.errors import IntegrityError

SHARD_PACK_BYTES = 256 << 10  # a shard manifest up to this travels in its batch's pack
PACK_BYTES = 1 << 20  # a batch's packed (compressed) bytes, at most: one page's worth
LEVEL = 3  # zstd's default level: 12 KB -> 0.7 KB in about 25 us

_local = threading.local()  # a compressor per thread: one is not safe to share


def _compressor() -> zstandard.ZstdCompressor:
    """This thread's compressor (made on its first use)."""
    made: zstandard.ZstdCompressor | None = getattr(_local, "compressor", None)
    if made is None:
        made = _local.compressor = zstandard.ZstdCompressor(level=LEVEL)
    return made


def packable(size: int, inline_bytes: int) -> bool:
    """Whether a shard manifest of `size` bytes goes in its batch's pack: larger than what
    stays inline in its record, at most `SHARD_PACK_BYTES`."""
    return inline_bytes < size <= SHARD_PACK_BYTES


def compress(manifest: bytes) -> bytes:
    """The manifest as stored in a pack (a zstd frame that states its content size)."""
    return _compressor().compress(manifest)


def pack(header: PartHeader, pack_id: str, offset: int, stored: int) -> PartHeader:
    """`header` (size, digest, session) placed in pack `pack_id` at `offset`."""
    return PartHeader(
        header.size, header.digest, session=header.session, pack=pack_id, offset=offset,
        stored=stored,
    )  # fmt: skip


def build(parts: Sequence[bytes]) -> tuple[bytes, list[int]]:
    """The pack of `parts` (compressed manifests) and each one's offset in it."""
    offsets: list[int] = []
    at = 0
    for part in parts:
        offsets.append(at)
        at += len(part)
    return b"".join(parts), offsets


def unpack(header: PartHeader, value: bytes, what: str) -> bytes:
    """The manifest `header` places in the pack `value`, decompressed and checked against the
    header's size and SHA-256 (`IntegrityError` if anything disagrees)."""
    stored = value[header.offset : header.offset + header.stored]
    if len(stored) != header.stored:
        raise IntegrityError(
            f"the manifest of {what} is cut short in its pack ({len(stored)} of "
            f"{header.stored} bytes)"
        )
    try:
        data = zstandard.ZstdDecompressor().decompress(stored, max_output_size=header.size)
    except zstandard.ZstdError as exc:
        raise IntegrityError(f"the manifest of {what} does not decompress: {exc}") from None
    if len(data) != header.size or hashlib.sha256(data).digest() != header.digest:
        raise IntegrityError(
            f"the manifest of {what} does not match its header "
            f"({len(data)} bytes, header says {header.size} and another digest)"
        )
    return data
