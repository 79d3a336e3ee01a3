"""The hub's gRPC servicer: the handler groups composed into `tensorhub.v1.TensorHub`.

Handlers authenticate the caller, confine every key to its tenant's prefix and call the
registries in `consistency`; see `ros.hub.rpc` for what they share.
"""

from __future__ import annotations

import logging

from consistency import Etcd, Keys
from consistency.usage import DEFAULT_HISTORY_PERIOD
from ros.hub.limits import Limits
from ros.hub.rpc import DEFAULT_ETCD_QUOTA_BYTES, CallContext, bearer, same, unary
from ros.hub.rpc_holders import HolderRPCs
from ros.hub.rpc_models import ModelRPCs
from ros.hub.rpc_sessions import SessionRPCs
from ros.hub.rpc_versions import VersionRPCs
from ros.hub.tenants import Quotas
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from ros.proto.tensorhub.v1 import hub_pb2_grpc
from ros.tokens import READ_KEY_PERIOD, READ_TOKEN_TTL, token_hash
from tensorhub.errors import PermissionDenied
from tensorhub.names import validate_name

log = logging.getLogger(__name__)


class HubServicer(SessionRPCs, VersionRPCs, HolderRPCs, ModelRPCs, hub_pb2_grpc.TensorHubServicer):
    """Handlers of `tensorhub.v1.TensorHub`."""

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
        super().__init__(
            etcd, keys, default_retain=default_retain, limits=limits,
            read_key_period=read_key_period, read_token_ttl=read_token_ttl,
            history_period=history_period, etcd_quota_bytes=etcd_quota_bytes,
        )  # fmt: skip
        self._admin_hash = token_hash(admin_token)

    def is_admin(self, token: str) -> bool:
        """Whether `token` is the hub's admin token (compared in constant time)."""
        return same(token_hash(token), self._admin_hash)

    @unary
    def CreateTenant(
        self, request: pb.CreateTenantRequest, context: CallContext
    ) -> pb.CreateTenantResponse:
        token = bearer(context)
        if token is None or not same(token_hash(token), self._admin_hash):
            raise PermissionDenied("CreateTenant needs the admin token")
        defaults = Quotas()
        quotas = Quotas(
            max_models=request.quotas.max_models or defaults.max_models,
            max_retained_versions=request.quotas.max_retained_versions
            or defaults.max_retained_versions,
            max_sessions=request.quotas.max_sessions or defaults.max_sessions,
            max_etcd_bytes=request.quotas.max_etcd_bytes or defaults.max_etcd_bytes,
            max_publishes_per_minute=request.quotas.max_publishes_per_minute
            or defaults.max_publishes_per_minute,
            max_history_bytes=request.quotas.max_history_bytes
            or request.quotas.max_etcd_bytes
            or defaults.max_history_bytes,
        )
        tenant_token = self.tenants.create(request.name, quotas)
        warning = self.tenants.overcommit(
            self.etcd_quota_bytes, self.history_period, self._timeout(context)
        )
        if warning:
            log.warning("CreateTenant %s: %s", request.name, warning)
        return pb.CreateTenantResponse(name=request.name, token=tenant_token, warning=warning)

    @unary
    def DeleteTenant(
        self, request: pb.DeleteTenantRequest, context: CallContext
    ) -> pb.DeleteTenantResponse:
        """Delete a tenant and everything it owns (admin token). Its name may be created
        again: a new epoch, so the old tenant's tokens and read tokens verify nowhere."""
        token = bearer(context)
        if token is None or not same(token_hash(token), self._admin_hash):
            raise PermissionDenied("DeleteTenant needs the admin token")
        name = validate_name(request.name, "tenant")
        return pb.DeleteTenantResponse(revision=self.tenants.delete(name, self._timeout(context)))
