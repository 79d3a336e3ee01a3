"""Listing handlers: `ListModels` (every model of the tenant, with its versions) and
`Inspect` (everything about one version, its holders a page at a time).

They answer an operator or a tool looking at what a tenant holds, not a reader fetching a
version (`ros.hub.rpc_versions`): they read the tenant's registries straight, page by
page, where Resolve answers from the replica's holder index. They depend on `ListingHub`,
the part of the replica they use; every etcd request they make goes through a registry of
`consistency`.
"""

from __future__ import annotations

from typing import Protocol

from ros.hub import manifest_reads
from ros.hub.call import CallContext
from ros.hub.convert import holder_to_pb
from ros.hub.manifest_cache import ManifestCache
from ros.hub.rpc import Registries, unary
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from tensorhub.errors import InvalidArgument, VersionNotFound
from tensorhub.names import validate_name, validate_version

DEFAULT_PAGE_SIZE = 500  # holders per Inspect page when the caller names no size
MAX_PAGE_SIZE = 5000  # the most holders one Inspect page lists


class ListingHub(Registries, Protocol):
    """What the listing handlers use of a replica besides `Registries` (running calls, their
    timeout, the tenant's registries): the manifest cache (a version's header and
    manifests, `ros.hub.manifest_reads`)."""

    manifest_cache: ManifestCache


class ListingRPCs:
    """Listing handlers: the tenant's models (`ListModels`), one version in full (`Inspect`)."""

    def __init__(self, hub: ListingHub) -> None:
        self.hub = hub

    @unary
    def ListModels(
        self, request: pb.ListModelsRequest, context: CallContext
    ) -> pb.ListModelsResponse:
        tenant = context.tenant()
        timeout = self.hub.timeout(context)
        versions = self.hub.versions(tenant)
        response = pb.ListModelsResponse()
        for model in versions.models(tenant.name, timeout=timeout):
            latest, revision = versions.latest(tenant.name, model, timeout=timeout)
            response.models.append(
                pb.ModelSummary(
                    name=model,
                    latest=latest,
                    versions=versions.versions(tenant.name, model, timeout=timeout),
                )
            )
            response.revision = max(response.revision, revision)
        if not response.revision:
            response.revision = versions.revision(tenant.name, timeout=timeout)
        return response

    @unary
    def Inspect(self, request: pb.InspectRequest, context: CallContext) -> pb.InspectResponse:
        """Everything about one version, with its holders listed by name, one page at a
        time (`page_size`, at most `MAX_PAGE_SIZE`; `page_token`: the last name of the
        previous page). Each page is one etcd read-only transaction (one revision)."""
        tenant = context.tenant()
        timeout = self.hub.timeout(context)
        model = validate_name(request.model, "model")
        if request.page_size < 0:
            raise InvalidArgument(f"page_size must not be negative, got {request.page_size}")
        size = min(request.page_size or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)
        after = validate_name(request.page_token, "page token") if request.page_token else ""
        versions = self.hub.versions(tenant)
        latest, _ = versions.latest(tenant.name, model, timeout=timeout)
        version = request.version or latest
        if version == 0:
            raise VersionNotFound(f"{model} has no published version")
        validate_version(version)
        header = manifest_reads.header(self.hub, tenant, model, version, timeout)
        page = self.hub.holders(tenant).page(
            tenant.name, model, version, after=after, size=size, timeout=timeout
        )
        if header.published_revision != page.published_revision:  # deleted, published again
            header = manifest_reads.header(
                self.hub, tenant, model, version, timeout, page.published_revision
            )
        response = pb.InspectResponse(
            version=version,
            latest=latest,
            holders=[holder_to_pb(h) for h in page.holders],
            pins=page.pins,
            published_revision=header.published_revision,
            revision=page.revision,
            retained=version in versions.retained(tenant.name, model, timeout=timeout),
            next_page_token=page.next_after,
            total_holders=page.total,
            shard_count=header.shard_count,
        )
        if not request.omit_manifest:
            manifest_reads.put_manifests(
                self.hub, response, tenant, model, version, header, None, timeout
            )
        return response
