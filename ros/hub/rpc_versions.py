"""Version handlers: latest, watch, resolve (with a read token).

They depend on `VersionHub`, the part of the replica they use, not on the whole
`ros.hub.state.HubState`, which provides it; every etcd request they make goes through a
registry of `consistency`. Publishing a version is `ros.hub.rpc_publish`'s; listing models
and inspecting a version, `ros.hub.rpc_listing`'s.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator
from typing import Protocol

from consistency.manifests import ManifestHeader
from ros.hub import manifest_reads
from ros.hub.call import AioContext, CallContext
from ros.hub.convert import holder_to_pb
from ros.hub.fanout import WatchFanout
from ros.hub.holder_index import HolderIndex
from ros.hub.limits import StreamLimits
from ros.hub.manifest_cache import ManifestCache
from ros.hub.rpc import Registries, streaming, unary
from ros.hub.tenants import Tenant, TenantStore
from ros.manifest_check import check_topology
from ros.metrics import HUB_WATCHES
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from ros.tokens import issue_read_token
from tensorhub.errors import InvalidArgument, TensorHubError, VersionNotFound
from tensorhub.names import validate_name, validate_version

log = logging.getLogger(__name__)


class VersionHub(Registries, Protocol):
    """What the version handlers use of a replica besides `Registries` (running calls, their
    timeout, the tenant's registries): the caches and shared watches that answer reads, and
    the read keys of Resolve."""

    manifest_cache: ManifestCache
    holder_index: HolderIndex
    fanout: WatchFanout
    streams: StreamLimits
    tenants: TenantStore
    read_token_ttl: float


class VersionRPCs:
    """Version handlers: latest, watch, resolve (with a read token)."""

    def __init__(self, hub: VersionHub) -> None:
        self.hub = hub

    @unary
    def Latest(self, request: pb.LatestRequest, context: CallContext) -> pb.LatestResponse:
        tenant = context.tenant()
        version, revision = self.hub.versions(tenant).latest(
            tenant.name, validate_name(request.model, "model"), timeout=self.hub.timeout(context)
        )
        return pb.LatestResponse(version=version, revision=revision)

    @streaming
    async def Watch(
        self, request: pb.WatchRequest, context: AioContext
    ) -> AsyncGenerator[pb.WatchEvent, None]:
        """Events of one model from an explicit revision, as an async generator: the
        shared (or private) etcd watch of `ros.hub.fanout` hands them to this stream's
        queue on the event loop; no thread waits for this stream. It holds a stream slot of
        its tenant and counts toward the distinct models its tenant watches on this replica
        (`ros.hub.limits`: `Overloaded` past either, before any etcd watch is made)."""
        tenant = CallContext.of(context).tenant()
        model = validate_name(request.model, "model")
        if request.start_revision <= 0:
            raise InvalidArgument("start_revision must be explicit and positive")
        with (
            self.hub.streams.stream("watch", tenant.name),
            self.hub.streams.watch_model(tenant.name, model),
        ):
            # Joining (or creating) a watch queues one request on the replica's etcd watch
            # stream: quick enough for the loop, and a stream cancelled meanwhile cannot
            # leave a subscription behind.
            sub = self.hub.fanout.subscribe(
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
                self.hub.fanout.unsubscribe(tenant.name, model, sub)

    @unary
    def Resolve(self, request: pb.ResolveRequest, context: CallContext) -> pb.ResolveResponse:
        """At most `MAX_CANDIDATES` holders of `model@version` for the caller (nearest
        first, its pipeline predecessor among them), a read token and, unless the caller
        has it (`omit_manifest`), the manifest: O(K log N) from this replica's holder index,
        at least as fresh as `min_revision` (docs/hub.md, "Resolve"). `with_companion`: the
        same answer for the delta's companion too, when the version has one."""
        tenant = context.tenant()
        timeout = self.hub.timeout(context)
        model = validate_name(request.model, "model")
        shard = request.shard if request.HasField("shard") else None
        check_topology(request.topology, "topology of the caller")  # bounded like a holder's
        floor = request.min_revision
        version = request.version
        if version == 0:
            version, moved = self._latest_kv(tenant, model, timeout)
            floor = max(floor, moved)  # the index must have seen that version appear
        validate_version(version)
        response, header = self._answer(
            tenant, model, version, shard, request, floor, request.fence, timeout
        )
        if not request.omit_manifest:
            manifest_reads.put_manifests(
                self.hub, response, tenant, model, version, header, shard, timeout
            )
        if request.with_companion and (shard is not None or not header.shard_count):
            self._put_companion(response, tenant, model, version, header, shard, request, timeout)
        return response

    def _answer(
        self,
        tenant: Tenant,
        model: str,
        version: int,
        shard: int | None,
        request: pb.ResolveRequest,
        floor: int,
        fence: int,
        timeout: float,
    ) -> tuple[pb.ResolveResponse, ManifestHeader]:
        """A Resolve's answer for `model@version` (of `shard`) without its manifest, and the
        version's header."""
        found = self.hub.holder_index.candidates(
            tenant.name, model, version, shard,
            min_revision=floor, timeout=timeout, topology=dict(request.topology),
            fence=fence, exclude=request.holder,
        )  # fmt: skip
        header = manifest_reads.header(self.hub, tenant, model, version, timeout, found.published)
        _check_shard(model, version, shard, header.shard_count)
        token, expiry = issue_read_token(
            self.hub.tenants.signing_key(tenant),
            tenant.name,
            model,
            version,
            self.hub.read_token_ttl,
        )
        response = pb.ResolveResponse(
            version=version,
            holders=[holder_to_pb(h) for h in found.candidates],
            read_token=token,
            token_expiry_unix=expiry,
            revision=found.revision,
            shard_count=header.shard_count,
            total_holders=found.total if shard is not None or not header.shard_count
            else found.total_all,
            manifest_digest=_digest(header, shard),
            manifest_omitted=request.omit_manifest,
        )  # fmt: skip
        return response, header

    def _put_companion(
        self,
        response: pb.ResolveResponse,
        tenant: Tenant,
        model: str,
        version: int,
        header: ManifestHeader,
        shard: int | None,
        request: pb.ResolveRequest,
        timeout: float,
    ) -> None:
        """The Resolve of the companion of `model@version` (of `shard`), manifest included,
        into `response.companion`: a reader applying the delta reads the companion next, and
        this spares it a call. Nothing when the version has no delta, or its companion is
        gone (the reader then resolves it itself, and is told why)."""
        section = manifest_reads.manifest(self.hub, tenant, model, version, shard, timeout).delta
        if not section.companion:
            return
        companion = section.companion
        try:
            answer, part = self._answer(
                tenant, companion, version, shard, pb.ResolveRequest(
                    topology=request.topology, holder=request.holder
                ), response.revision, 0, timeout,
            )  # fmt: skip
            manifest_reads.put_manifests(
                self.hub, answer, tenant, companion, version, part, shard, timeout
            )
        except TensorHubError as exc:
            log.info("resolve %s@%d: its companion %s is not there (%s)",
                     model, version, companion, exc)  # fmt: skip
            return
        response.companion.CopyFrom(answer)

    def _latest_kv(self, tenant: Tenant, model: str, timeout: float) -> tuple[int, int]:
        """(latest version, the revision `latest` was moved at): one linearizable get."""
        latest, moved = self.hub.versions(tenant).latest_moved(tenant.name, model, timeout=timeout)
        if latest == 0:
            raise VersionNotFound(f"{model} has no published version")
        return latest, moved


def _check_shard(model: str, version: int, shard: int | None, count: int) -> None:
    """A shard may be asked for only of a model-parallel version, and in range."""
    if shard is None:
        return
    if not count:
        raise InvalidArgument(f"{model}@{version} is not model-parallel: omit shard")
    if not 0 <= shard < count:
        raise InvalidArgument(f"shard {shard} out of range: {model}@{version} has {count}")


def _digest(header: ManifestHeader, shard: int | None) -> bytes:
    """SHA-256 of the manifest asked for (of a model-parallel version without a shard: of
    its shards' digests in order)."""
    if shard is not None:
        return header.shards[shard].digest
    return header.digest
