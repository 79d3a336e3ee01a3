"""The hub's cache of manifests: immutable per version, so read from etcd once per replica.

A version's manifest (or a shard's) never changes once published, so each replica keeps the
parsed message by (tenant, model, version, shard), bounded by the bytes of the serialized
manifests (least recently used dropped first), and each version's header (shard count,
sizes and SHA-256 digests) by (tenant, model, version), bounded by count. Whether a version
still exists is not the cache's business: the caller checks that first (the holder index
sees the version's keys deleted by retention).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

from consistency.manifests import ManifestHeader
from ros.proto.tensorhub.v1 import hub_pb2 as pb

DEFAULT_MAX_BYTES = 256 << 20  # serialized manifests kept per replica
MAX_HEADERS = 4096  # version headers kept per replica

K = TypeVar("K")
V = TypeVar("V")


class _Lru(Generic[K, V]):
    """A thread-safe LRU map bounded by the summed `size` of its values."""

    def __init__(self, limit: int, size: Callable[[V], int]) -> None:
        self._limit, self._size = limit, size
        self._lock = threading.Lock()
        self._items: OrderedDict[K, V] = OrderedDict()
        self._used = 0

    def get(self, key: K) -> V | None:
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def put(self, key: K, value: V) -> None:
        size = self._size(value)
        if size > self._limit:
            return  # larger than the whole cache: not kept
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._used -= self._size(old)
            self._items[key] = value
            self._used += size
            while self._used > self._limit:
                _, dropped = self._items.popitem(last=False)
                self._used -= self._size(dropped)

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    @property
    def used(self) -> int:
        with self._lock:
            return self._used


VersionKey = tuple[str, str, int]  # tenant, model, version
PartKey = tuple[str, str, int, int | None]  # ..., shard (None: the whole version)


class ManifestCache:
    """Parsed manifests bounded by bytes, and version headers bounded by count."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES, max_headers: int = MAX_HEADERS) -> None:
        self._parts: _Lru[PartKey, tuple[pb.Manifest, int]] = _Lru(max_bytes, lambda v: v[1])
        self._headers: _Lru[VersionKey, ManifestHeader] = _Lru(max_headers, lambda _: 1)

    def header(self, key: VersionKey, load: Callable[[], ManifestHeader]) -> ManifestHeader:
        """The version's header, from the cache or `load()` (then kept)."""
        header = self._headers.get(key)
        if header is None:
            header = load()
            self._headers.put(key, header)
        return header

    def manifest(self, key: PartKey, load: Callable[[], bytes]) -> pb.Manifest:
        """The parsed manifest of a version (or of one shard), from the cache or `load()`.
        The message returned is shared: copy it (`CopyFrom`), never change it."""
        cached = self._parts.get(key)
        if cached is not None:
            return cached[0]
        raw = load()
        manifest = pb.Manifest.FromString(raw)
        self._parts.put(key, (manifest, len(raw)))
        return manifest

    @property
    def bytes_used(self) -> int:
        return self._parts.used
