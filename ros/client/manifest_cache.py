"""The SDK's cache of manifests, by (model, version, shard): a manifest never changes.

A client that has a version's manifest asks the hub to leave it out of later Resolves of
that version (`omit_manifest`): a refresh of the holders during a failover, or a second
fetch of the same version, then moves a few hundred bytes instead of the whole manifest
(megabytes for a model of 100,000 tensors). The hub still sends the manifest's digest, so a
cached copy that does not match is never used. Bounded by bytes, least recently used first.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from ros.proto.tensorhub.v1 import hub_pb2 as pb

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
        self._max = max_bytes
        self._lock = threading.Lock()
        self._items: OrderedDict[Key, CachedManifest] = OrderedDict()
        self._used = 0

    def get(self, key: Key) -> CachedManifest | None:
        with self._lock:
            item = self._items.get(key)
            if item is not None:
                self._items.move_to_end(key)
            return item

    def put(self, key: Key, item: CachedManifest) -> None:
        if item.nbytes > self._max or not item.digest:
            return  # too large to keep, or from a hub that sends no digest
        with self._lock:
            self._pop(key)
            self._items[key] = item
            self._used += item.nbytes
            while self._used > self._max:
                _, dropped = self._items.popitem(last=False)
                self._used -= dropped.nbytes

    def pop(self, key: Key) -> None:
        with self._lock:
            self._pop(key)

    def _pop(self, key: Key) -> None:
        old = self._items.pop(key, None)
        if old is not None:
            self._used -= old.nbytes

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)


def _copy(manifest: pb.Manifest) -> pb.Manifest:
    own = pb.Manifest()
    own.CopyFrom(manifest)
    return own
