"""A version's header and manifests as the version handlers read them: through this
replica's `ManifestCache`, each read from etcd once.

Publish (a companion's base header), Resolve and Inspect all read them the same way, so the
reads live here, apart from any one handler group; each takes the part of the replica it
uses (`CachedVersions`).
"""

from __future__ import annotations

from typing import Protocol

from consistency import VersionRegistry
from consistency.manifests import ManifestHeader
from ros.hub.manifest_cache import ManifestCache
from ros.hub.tenants import Tenant
from ros.proto.tensorhub.v1 import hub_pb2 as pb


class CachedVersions(Protocol):
    """What the reads use of a replica: the tenant's version registry and the cache."""

    manifest_cache: ManifestCache

    def versions(self, tenant: Tenant) -> VersionRegistry: ...


def header(
    hub: CachedVersions,
    tenant: Tenant,
    model: str,
    version: int,
    timeout: float,
    published: int = 0,
) -> ManifestHeader:
    """The version's manifest header (shards, digests), cached: it never changes, but a
    model deleted (`DeleteModel`) may publish the same version number again. So a
    caller that knows the create revision of the version's manifest key (`published`)
    passes it, and a cached header of an earlier incarnation is dropped, with its
    manifests, and read again."""
    versions = hub.versions(tenant)
    key = (tenant.name, model, version)

    def load() -> ManifestHeader:
        return versions.header(tenant.name, model, version, timeout=timeout)

    found = hub.manifest_cache.header(key, load)
    if published and found.published_revision != published:
        hub.manifest_cache.forget(key, found.shard_count)
        found = hub.manifest_cache.header(key, load)
    return found


def put_manifests(
    hub: CachedVersions,
    response: pb.ResolveResponse | pb.InspectResponse,
    tenant: Tenant,
    model: str,
    version: int,
    header: ManifestHeader,
    shard: int | None,
    timeout: float,
) -> None:
    """The manifest asked for: the whole version's, shard `shard`'s, or (a model-parallel
    version, no shard asked) one per shard; each read from etcd once per replica."""
    if header.shard_count and shard is None:
        for index in range(header.shard_count):
            response.shards.append(manifest(hub, tenant, model, version, index, timeout))
    else:
        response.manifest.CopyFrom(manifest(hub, tenant, model, version, shard, timeout))


def manifest(
    hub: CachedVersions,
    tenant: Tenant,
    model: str,
    version: int,
    part: int | None,
    timeout: float,
) -> pb.Manifest:
    """The manifest of `model@version` (of shard `part`), from this replica's cache or read
    once from etcd; shared: never change it."""
    versions = hub.versions(tenant)
    return hub.manifest_cache.manifest(
        (tenant.name, model, version, part),
        lambda: versions.manifest(tenant.name, model, version, part, timeout=timeout),
    )
