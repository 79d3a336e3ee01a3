"""Version handlers: publish, latest, watch, resolve (with a read token), list, inspect."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

from consistency import HolderState, VersionInfo
from consistency.manifests import check_manifest_size, check_shard_count
from consistency.quota import CountedCreate
from ros.hub.convert import holder_from_pb, holder_to_pb
from ros.hub.rpc import AioContext, CallContext, HubBase, streaming, unary
from ros.hub.tenants import Tenant
from ros.metrics import HUB_WATCHES
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from ros.tokens import issue_read_token
from tensorhub.errors import InvalidArgument, VersionNotFound
from tensorhub.names import validate_name, validate_version


class VersionRPCs(HubBase):
    """Version handlers: publish, latest, watch, resolve (with a read token), list, inspect."""

    @unary
    def Publish(self, request: pb.PublishRequest, context: CallContext) -> pb.PublishResponse:
        tenant = self._tenant(context)
        timeout = self._timeout(context)
        model = validate_name(request.model, "model")
        version = validate_version(request.version)
        if request.shard_count:  # bounds first: a limit answers before any work is done
            check_shard_count(request.shard_count)
        check_manifest_size(request.manifest.ByteSize())
        manifest = request.manifest.SerializeToString()
        if not request.manifest.tensors:
            raise InvalidArgument("manifest lists no tensors")
        holder = holder_from_pb(request.holder, default_state=HolderState.COMPLETE)
        self._own_session(tenant, holder.session, timeout)
        versions = self._versions(tenant)
        quota = CountedCreate(
            self.etcd,
            self.keys.quota_fence(tenant.name, "models"),
            tenant.quotas.max_models,
            lambda t: versions.models(tenant.name, timeout=t),
            f"models of tenant {tenant.name}",
        )

        def admit(remaining: float) -> tuple[list[Any], list[Any]]:
            return quota.admit(remaining, model)

        if request.shard_count:
            published = versions.publish_shard(
                tenant.name,
                model,
                version,
                request.shard_index,
                request.shard_count,
                manifest,
                holder,
                timeout=timeout,
                admit_model=admit,
            )
        else:
            published = versions.publish(
                tenant.name, model, version, manifest, holder, timeout=timeout, admit_model=admit
            )
        return pb.PublishResponse(
            version=published.version, revision=published.revision, visible=published.visible
        )

    @unary
    def Latest(self, request: pb.LatestRequest, context: CallContext) -> pb.LatestResponse:
        tenant = self._tenant(context)
        version, revision = self._versions(tenant).latest(
            tenant.name, validate_name(request.model, "model"), timeout=self._timeout(context)
        )
        return pb.LatestResponse(version=version, revision=revision)

    @streaming
    async def Watch(
        self, request: pb.WatchRequest, context: AioContext
    ) -> AsyncGenerator[pb.WatchEvent, None]:
        """Events of one model from an explicit revision, as an async generator: the
        shared (or private) etcd watch of `ros.hub.fanout` hands them to this stream's
        queue on the event loop; no thread waits for this stream."""
        call = CallContext.of(context)
        tenant = await self._blocking(self._tenant, call)
        model = validate_name(request.model, "model")
        if request.start_revision <= 0:
            raise InvalidArgument("start_revision must be explicit and positive")
        with self.streams.stream("watch", tenant.name):
            # Joining (or creating) a watch only starts its threads: quick enough for the loop,
            # and a stream cancelled meanwhile cannot leave a subscription behind.
            sub = self._fanout.subscribe(
                tenant.name,
                model,
                request.start_revision,
                request.versions_only,
                asyncio.get_running_loop(),
            )
            HUB_WATCHES.inc()
            try:
                while True:
                    yield await sub.next()
            finally:
                HUB_WATCHES.dec()
                self._fanout.unsubscribe(tenant.name, model, sub)

    @unary
    def Resolve(self, request: pb.ResolveRequest, context: CallContext) -> pb.ResolveResponse:
        tenant = self._tenant(context)
        timeout = self._timeout(context)
        model = validate_name(request.model, "model")
        info, _ = self._describe(tenant, model, request.version, timeout)
        version = info.version
        token, expiry = issue_read_token(
            self.tenants.read_key(tenant.name), tenant.name, model, version
        )
        response = pb.ResolveResponse(
            version=version,
            holders=[holder_to_pb(h) for h in info.holders],
            read_token=token,
            token_expiry_unix=expiry,
            revision=info.revision,
        )
        _put_manifests(response, info)
        return response

    @unary
    def ListModels(
        self, request: pb.ListModelsRequest, context: CallContext
    ) -> pb.ListModelsResponse:
        tenant = self._tenant(context)
        timeout = self._timeout(context)
        versions = self._versions(tenant)
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
            response.revision = self.etcd.get(self.keys.tenant(tenant.name), timeout=timeout)[1]
        return response

    @unary
    def Inspect(self, request: pb.InspectRequest, context: CallContext) -> pb.InspectResponse:
        tenant = self._tenant(context)
        timeout = self._timeout(context)
        model = validate_name(request.model, "model")
        versions = self._versions(tenant)
        info, latest = self._describe(tenant, model, request.version, timeout, need_latest=True)
        version = info.version
        response = pb.InspectResponse(
            version=version,
            latest=latest,
            holders=[holder_to_pb(h) for h in info.holders],
            pins=info.pins,
            seeds=info.seeds,
            published_revision=info.published_revision,
            revision=info.revision,
            retained=version in versions.retained(tenant.name, model, timeout=timeout),
        )
        _put_manifests(response, info)
        return response

    def _describe(
        self,
        tenant: Tenant,
        model: str,
        requested: int,
        timeout: float,
        *,
        need_latest: bool = False,
    ) -> tuple[VersionInfo, int]:
        """The version asked for (0: the latest) and the latest version (read only if needed)."""
        versions = self._versions(tenant)
        latest = 0
        if requested == 0 or need_latest:
            latest, _ = versions.latest(tenant.name, model, timeout=timeout)
        version = requested or latest
        if version == 0:
            raise VersionNotFound(f"{model} has no published version")
        info = versions.describe(tenant.name, model, validate_version(version), timeout=timeout)
        return info, latest


def _put_manifests(response: pb.ResolveResponse | pb.InspectResponse, info: VersionInfo) -> None:
    """The version's manifest, or one manifest per shard of a model-parallel version."""
    if info.shards:
        for shard in info.shards:
            response.shards.append(pb.Manifest.FromString(shard.manifest))
    else:
        response.manifest.ParseFromString(info.manifest)
