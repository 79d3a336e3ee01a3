"""Tenant handlers (the admin's): `CreateTenant` and `DeleteTenant`.

They depend on `TenantHub`, the part of the replica they use (the tenant store, the call
timeout, the two etcd budgets), not on the whole `ros.hub.state.HubState`, which provides it.
"""

from __future__ import annotations

import logging
from typing import Protocol

from ros.hub.call import CallContext
from ros.hub.rpc import Runs, unary
from ros.hub.tenants import Quotas, TenantStore
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from tensorhub.names import validate_name

log = logging.getLogger(__name__)


class TenantHub(Runs, Protocol):
    """What the tenant handlers use of a replica, besides running calls (`Runs`)."""

    tenants: TenantStore
    etcd_quota_bytes: int  # etcd's --quota-backend-bytes, against which tenants' budgets add up
    history_period: float  # seconds over which each tenant's etcd history budget refills

    def timeout(self, context: CallContext) -> float: ...


class TenantRPCs:
    """Tenant handlers: create and delete tenants, with the admin token."""

    def __init__(self, hub: TenantHub) -> None:
        self.hub = hub

    @unary
    def CreateTenant(
        self, request: pb.CreateTenantRequest, context: CallContext
    ) -> pb.CreateTenantResponse:
        """Create a tenant with its quotas (a zero quota takes the default); answers its
        token, and a warning when the tenants' etcd budgets together exceed etcd's quota."""
        context.admin("CreateTenant")
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
        hub = self.hub
        tenant_token = hub.tenants.create(request.name, quotas)
        warning = hub.tenants.overcommit(
            hub.etcd_quota_bytes, hub.history_period, hub.timeout(context)
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
        context.admin("DeleteTenant")
        name = validate_name(request.name, "tenant")
        revision = self.hub.tenants.delete(name, self.hub.timeout(context))
        return pb.DeleteTenantResponse(revision=revision)
