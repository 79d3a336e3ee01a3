"""The SDK's cache of manifests, by (model, version, shard): a manifest never changes.

A client that has a version's manifest asks the hub to leave it out of later Resolves of
that version (`omit_manifest`): a refresh of the holders during a failover, or a second
fetch of the same version, then moves a few hundred bytes instead of the whole manifest
(megabytes for a model of 100,000 tensors). The hub still sends the manifest's digest, so a
cached copy that does not match is never used. Bounded by bytes, least recently used first.
"""

from __future__ import annotations

from dataclasses import dataclass

from ros.proto.tensorhub.v1 import hub_pb2 as pb
from tensorhub.lru import SizedLru

DEFAULT_MAX_BYTES = 64 << 20  # serialized manifests a client keeps

Key = tuple[str, int, int | None]  # model, version, shard (None: the whole version)


@dataclass(frozen=True)
class CachedManifest:
    """The manifest part of one Resolve answer: the manifest, or one per shard."""

    manifest: pb.Manifest
    shards: tuple[pb.Manifest, ...]
    digest: bytes
    nbytes: int

    @classmethod
    def of(cls, answer: pb.ResolveResponse) -> CachedManifest:
        manifest = pb.Manifest()
        manifest.CopyFrom(answer.manifest)  # our own copy, not a part of `answer`
        shards = tuple(_copy(m) for m in answer.shards)
        nbytes = manifest.ByteSize() + sum(m.ByteSize() for m in shards)
        return cls(manifest, shards, bytes(answer.manifest_digest), nbytes)

    def fill(self, answer: pb.ResolveResponse) -> None:
        """Put the cached manifest(s) into an answer that omitted them."""
        answer.manifest.CopyFrom(self.manifest)
        del answer.shards[:]
        answer.shards.extend(self.shards)


class ManifestCache:
    """A thread-safe LRU of `CachedManifest`s, bounded by their serialized bytes."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self._items: SizedLru[Key, CachedManifest] = SizedLru(max_bytes, lambda m: m.nbytes)

    def get(self, key: Key) -> CachedManifest | None:
        return self._items.get(key)

    def put(self, key: Key, item: CachedManifest) -> None:
        if item.digest:  # a hub that sends no digest: its answers are never trusted later
            self._items.put(key, item)

    def pop(self, key: Key) -> None:
        self._items.pop(key)

    def __len__(self) -> int:
        return len(self._items)


def _copy(manifest: pb.Manifest) -> pb.Manifest:
    own = pb.Manifest()
    own.CopyFrom(manifest)
    return own
