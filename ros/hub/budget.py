"""A tenant's etcd budget at Publish: refuse before any write, then charge in the publish's
own transaction (`consistency.usage`: live manifest bytes and publishes per minute, from the
tenant's `Quotas`)."""

from __future__ import annotations

from collections.abc import Callable

from consistency import Etcd, Keys
from consistency.usage import Guard, TenantBudget
from ros.hub.tenants import Tenant
from ros.metrics import HUB_PUBLISHES_REFUSED
from tensorhub.errors import QuotaExceeded


def publish_charge(
    etcd: Etcd, keys: Keys, tenant: Tenant, size: int, shard_count: int, timeout: float
) -> Callable[[float], Guard]:
    """Check that a publish of a `size`-byte manifest (one shard of `shard_count`, or a
    whole version with 0) fits the tenant's budget now, else `QuotaExceeded` with nothing
    written; returns the charge its transaction adds (it checks again, race-free)."""
    budget = TenantBudget(
        etcd, keys, tenant.name,
        max_bytes=tenant.quotas.max_etcd_bytes,
        publishes_per_minute=tenant.quotas.max_publishes_per_minute,
    )  # fmt: skip
    publishes = 1.0 / shard_count if shard_count else 1.0

    def charge(remaining: float) -> Guard:
        try:
            return budget.charge(size, publishes, remaining)
        except QuotaExceeded:
            HUB_PUBLISHES_REFUSED.labels("etcd_budget").inc()
            raise

    charge(timeout)
    return charge
