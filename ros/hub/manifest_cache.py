"""The hub's cache of manifests: immutable per version, so read from etcd once per replica.

A version's manifest (or a shard's) never changes once published, so each replica keeps the
parsed message by (tenant, model, version, shard), bounded by the bytes of the serialized
manifests (least recently used dropped first), and each version's header (shard count,
sizes and SHA-256 digests) by (tenant, model, version), bounded by count. Whether a version
still exists is not the cache's business: the caller checks that first (the holder index
sees the version's keys deleted by retention), and drops (`forget`) a version whose manifest
key was created again since (a model deleted, then published again).
"""

from __future__ import annotations

from collections.abc import Callable

from consistency.manifests import ManifestHeader
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from tensorhub.lru import SizedLru

DEFAULT_MAX_BYTES = 256 << 20  # serialized manifests kept per replica
MAX_HEADERS = 4096  # version headers kept per replica

VersionKey = tuple[str, str, int]  # tenant, model, version
PartKey = tuple[str, str, int, int | None]  # ..., shard (None: the whole version)


class ManifestCache:
    """Parsed manifests bounded by bytes, and version headers bounded by count."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES, max_headers: int = MAX_HEADERS) -> None:
        # (parsed manifest, its serialized size), bounded by the sizes
        self._parts: SizedLru[PartKey, tuple[pb.Manifest, int]] = SizedLru(
            max_bytes, lambda v: v[1]
        )
        self._headers: SizedLru[VersionKey, ManifestHeader] = SizedLru(max_headers, lambda _: 1)

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

    def seed(
        self, key: VersionKey, header: ManifestHeader, manifest: pb.Manifest, size: int
    ) -> None:
        """Keep a whole version's header and parsed manifest as this replica just published
        them (`manifest`, `size` serialized bytes; kept as given: never change it): the
        readers that resolve a new version, all at once, find it here instead of each
        reading it from etcd. A header that is not the manifest key's (a publish retried
        after its first attempt landed) is replaced by the first caller that knows the
        key's create revision (`forget`), as any cached header of an earlier incarnation."""
        self._headers.put(key, header)
        self._parts.put((*key, None), (manifest, size))

    def forget(self, key: VersionKey, shard_count: int) -> None:
        """Drop a version's header and its manifests (of its `shard_count` shards, or whole):
        the version was deleted and published again under the same number."""
        self._headers.pop(key)
        for part in [None, *range(shard_count)]:
            self._parts.pop((*key, part))
