"""The hub's gRPC servicer: `tensorhub.v1.TensorHub`, delegating each call to its handler group.

One `ros.hub.state.HubState` per replica is shared by the groups: sessions
(`ros.hub.rpc_sessions`), publishing (`rpc_publish`), versions (`rpc_versions`),
listing (`rpc_listing`), holders (`rpc_holders`), models (`rpc_models`), tenants
(`rpc_tenants`) and layouts (`rpc_layouts`). Each group authenticates nothing itself: the
caller comes with the call (`ros.hub.call`), and confines every key to its tenant's prefix.
Construct it, `start()` it (its first etcd I/O), `close()` it.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Any

from consistency import Etcd, Keys
from consistency.usage import DEFAULT_HISTORY_PERIOD
from ros.hub.call import AioContext
from ros.hub.limits import Limits
from ros.hub.rpc_holders import HolderRPCs
from ros.hub.rpc_layouts import LayoutRPCs
from ros.hub.rpc_listing import ListingRPCs
from ros.hub.rpc_models import ModelRPCs
from ros.hub.rpc_publish import PublishRPCs
from ros.hub.rpc_sessions import SessionRPCs
from ros.hub.rpc_tenants import TenantRPCs
from ros.hub.rpc_versions import VersionRPCs
from ros.hub.state import DEFAULT_ETCD_QUOTA_BYTES, HubState
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from ros.proto.tensorhub.v1 import hub_pb2_grpc
from ros.tokens import READ_KEY_PERIOD, READ_TOKEN_TTL


class HubServicer(hub_pb2_grpc.TensorHubServicer):
    """Handlers of `tensorhub.v1.TensorHub`, each delegated to its group."""

    def __init__(
        self,
        etcd: Etcd,
        keys: Keys,
        *,
        admin_token: str,
        default_retain: int = 2,
        limits: Limits | None = None,
        read_key_period: float = READ_KEY_PERIOD,
        read_token_ttl: float = READ_TOKEN_TTL,
        history_period: float = DEFAULT_HISTORY_PERIOD,
        etcd_quota_bytes: int = DEFAULT_ETCD_QUOTA_BYTES,
    ) -> None:
        """No I/O: `start()` does it."""
        self.hub = HubState(
            etcd, keys, admin_token=admin_token, default_retain=default_retain, limits=limits,
            read_key_period=read_key_period, read_token_ttl=read_token_ttl,
            history_period=history_period, etcd_quota_bytes=etcd_quota_bytes,
        )  # fmt: skip
        self.session_rpcs = SessionRPCs(self.hub)
        self.publish_rpcs = PublishRPCs(self.hub)
        self.version_rpcs = VersionRPCs(self.hub)
        self.listing_rpcs = ListingRPCs(self.hub)
        self.holder_rpcs = HolderRPCs(self.hub)
        self.model_rpcs = ModelRPCs(self.hub)
        self.tenant_rpcs = TenantRPCs(self.hub)
        self.layout_rpcs = LayoutRPCs(self.hub)

    def start(self) -> HubServicer:
        """The replica's first etcd I/O (`HubState.start`); returns self."""
        self.hub.start()
        return self

    def close(self) -> None:
        self.hub.close()

    # -- streams ---------------------------------------------------------------------------

    async def KeepAlive(
        self, requests: AsyncIterator[pb.KeepAliveRequest], context: AioContext
    ) -> AsyncGenerator[pb.KeepAliveResponse, None]:
        async with aclosing(self.session_rpcs.KeepAlive(requests, context)) as stream:
            async for response in stream:
                yield response

    async def Watch(
        self, request: pb.WatchRequest, context: AioContext
    ) -> AsyncGenerator[pb.WatchEvent, None]:
        async with aclosing(self.version_rpcs.Watch(request, context)) as stream:
            async for event in stream:
                yield event

    # -- unary calls -----------------------------------------------------------------------

    async def OpenSession(
        self, request: pb.OpenSessionRequest, context: AioContext
    ) -> pb.OpenSessionResponse:
        return await self.session_rpcs.OpenSession(request, context)

    async def CloseSession(
        self, request: pb.CloseSessionRequest, context: AioContext
    ) -> pb.CloseSessionResponse:
        return await self.session_rpcs.CloseSession(request, context)

    async def Publish(self, request: pb.PublishRequest, context: AioContext) -> pb.PublishResponse:
        return await self.publish_rpcs.Publish(request, context)

    async def PublishShards(
        self, requests: AsyncIterator[Any], context: AioContext
    ) -> pb.PublishShardsResponse:
        """Each request a `RawPublishRequest` (`ros.hub.server` reads this call's so)."""
        return await self.publish_rpcs.PublishShards(requests, context)

    async def Latest(self, request: pb.LatestRequest, context: AioContext) -> pb.LatestResponse:
        return await self.version_rpcs.Latest(request, context)

    async def Resolve(self, request: pb.ResolveRequest, context: AioContext) -> pb.ResolveResponse:
        return await self.version_rpcs.Resolve(request, context)

    async def ListModels(
        self, request: pb.ListModelsRequest, context: AioContext
    ) -> pb.ListModelsResponse:
        return await self.listing_rpcs.ListModels(request, context)

    async def Inspect(self, request: pb.InspectRequest, context: AioContext) -> pb.InspectResponse:
        return await self.listing_rpcs.Inspect(request, context)

    async def RegisterHolder(
        self, request: pb.RegisterHolderRequest, context: AioContext
    ) -> pb.RegisterHolderResponse:
        return await self.holder_rpcs.RegisterHolder(request, context)

    async def UpdateHolder(
        self, request: pb.UpdateHolderRequest, context: AioContext
    ) -> pb.UpdateHolderResponse:
        return await self.holder_rpcs.UpdateHolder(request, context)

    async def ReleaseHolder(
        self, request: pb.ReleaseHolderRequest, context: AioContext
    ) -> pb.ReleaseHolderResponse:
        return await self.holder_rpcs.ReleaseHolder(request, context)

    async def Pin(self, request: pb.PinRequest, context: AioContext) -> pb.PinResponse:
        return await self.holder_rpcs.Pin(request, context)

    async def Unpin(self, request: pb.UnpinRequest, context: AioContext) -> pb.UnpinResponse:
        return await self.holder_rpcs.Unpin(request, context)

    async def DeleteModel(
        self, request: pb.DeleteModelRequest, context: AioContext
    ) -> pb.DeleteModelResponse:
        return await self.model_rpcs.DeleteModel(request, context)

    async def RegisterLayoutHolder(
        self, request: pb.RegisterLayoutHolderRequest, context: AioContext
    ) -> pb.RegisterLayoutHolderResponse:
        return await self.layout_rpcs.RegisterLayoutHolder(request, context)

    async def ResolveLayout(
        self, request: pb.ResolveLayoutRequest, context: AioContext
    ) -> pb.ResolveLayoutResponse:
        return await self.layout_rpcs.ResolveLayout(request, context)

    async def ResolveLayoutCover(
        self, request: pb.ResolveLayoutCoverRequest, context: AioContext
    ) -> pb.ResolveLayoutCoverResponse:
        return await self.layout_rpcs.ResolveLayoutCover(request, context)

    async def ReleaseLayoutHolder(
        self, request: pb.ReleaseLayoutHolderRequest, context: AioContext
    ) -> pb.ReleaseLayoutHolderResponse:
        return await self.layout_rpcs.ReleaseLayoutHolder(request, context)

    async def DeclareLayout(
        self, request: pb.DeclareLayoutRequest, context: AioContext
    ) -> pb.DeclareLayoutResponse:
        return await self.layout_rpcs.DeclareLayout(request, context)

    async def RetireLayout(
        self, request: pb.RetireLayoutRequest, context: AioContext
    ) -> pb.RetireLayoutResponse:
        return await self.layout_rpcs.RetireLayout(request, context)

    async def DeclaredLayouts(
        self, request: pb.DeclaredLayoutsRequest, context: AioContext
    ) -> pb.DeclaredLayoutsResponse:
        return await self.layout_rpcs.DeclaredLayouts(request, context)

    async def CreateTenant(
        self, request: pb.CreateTenantRequest, context: AioContext
    ) -> pb.CreateTenantResponse:
        return await self.tenant_rpcs.CreateTenant(request, context)

    async def DeleteTenant(
        self, request: pb.DeleteTenantRequest, context: AioContext
    ) -> pb.DeleteTenantResponse:
        return await self.tenant_rpcs.DeleteTenant(request, context)
