"""A tenant's etcd budget at Publish: refuse before any write, then charge in the publish's
own transaction (`consistency.usage`: live manifest bytes and publishes per minute, from the
tenant's `Quotas`); for a batch of shards, once per batch."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from consistency import Etcd, Keys, ops
from consistency.manifests import INLINE_BYTES, SHARD_INLINE_BYTES
from consistency.publishing import Charge
from consistency.usage import Guard, TenantBudget, UsageCache
from ros.hub.tenants import Tenant
from ros.metrics import HUB_PUBLISHES_REFUSED
from tensorhub.errors import QuotaExceeded
from tensorhub.lru import SizedLru

MAX_MODEL_LOCKS = 4096  # models publishing through one process at once, remembered
_locks: SizedLru[tuple[str, str], threading.Lock] = SizedLru(MAX_MODEL_LOCKS, lambda _: 1)
_locks_guard = threading.Lock()


def model_serial(tenant: str, model: str) -> threading.Lock:
    """The lock this process's whole-version publishes of one model hold around each
    publish transaction.

    Publishes of one model compare its `latest` and their tenant's usage key: unserialized,
    a model's concurrent publishes fail each other's compares and retry. Serialized here,
    each commits at its first attempt. The lock is per model, not per tenant, so one
    tenant's unrelated models never wait for each other (they race only in etcd, on the
    usage compare, where the loser reads again). Shards of a model-parallel version do not
    take it: they are batched (`ros.hub.shard_publish`). An evicted lock only costs
    retries, never correctness."""
    with _locks_guard:
        lock = _locks.get((tenant, model))
        if lock is None:
            lock = threading.Lock()
            _locks.put((tenant, model), lock)
        return lock


def _budget(
    etcd: Etcd,
    keys: Keys,
    tenant: Tenant,
    history_period: float,
    sharded: bool,
    cache: UsageCache | None = None,
) -> TenantBudget:
    return TenantBudget(
        etcd, keys, tenant.name,
        max_bytes=tenant.quotas.max_etcd_bytes,
        publishes_per_minute=tenant.quotas.max_publishes_per_minute,
        history_bytes=tenant.quotas.max_history_bytes,
        history_period=history_period,
        inline=SHARD_INLINE_BYTES if sharded else INLINE_BYTES,
        cache=cache,
    )  # fmt: skip


def publish_charge(
    etcd: Etcd,
    keys: Keys,
    tenant: Tenant,
    size: int,
    shard_count: int,
    timeout: float,
    history_period: float,
    cache: UsageCache | None = None,
) -> Charge:
    """Check that a publish of a `size`-byte manifest (one shard of `shard_count`, or a
    whole version with 0) fits the tenant's budget now, else `QuotaExceeded` with nothing
    written; returns the charge its transaction adds (it checks again, race-free).
    `history_period`: the compactor's interval, over which the history budget refills;
    `cache`: the replica's usage cache (`consistency.usage.UsageCache`): the check and the
    charge read the usage key only when it holds no copy, or after a failed transaction."""
    budget = _budget(etcd, keys, tenant, history_period, bool(shard_count), cache)
    charge = _Counted(budget.charge_for(size, 1.0 / shard_count if shard_count else 1.0))
    charge(timeout)
    return charge


class _Counted:
    """A charge whose refusals are counted in `tensorhub_hub_publishes_refused_total`."""

    def __init__(self, charge: Charge) -> None:
        self._charge = charge

    def __call__(self, timeout: float) -> Guard:
        try:
            return self._charge(timeout)
        except QuotaExceeded:
            HUB_PUBLISHES_REFUSED.labels("etcd_budget").inc()
            raise

    def settle(self, revision: int | None) -> None:
        self._charge.settle(revision)


class BatchBudget:
    """The charge of a batch of one version's shards (`consistency.shard_commit.Budget`):
    one compare and put for the batch, each shard 1/`shard_count` of a publish, against
    the usage the batch read."""

    def __init__(
        self, etcd: Etcd, keys: Keys, tenant: Tenant, shard_count: int, history_period: float
    ) -> None:
        self._budget = _budget(etcd, keys, tenant, history_period, True)
        self._publishes = 1.0 / shard_count
        self.key = self._budget.key

    def charge(
        self, sizes: Sequence[int], usage: ops.KV | None
    ) -> tuple[int, list[ops.Cmp], list[ops.Op], QuotaExceeded | None]:
        admitted, compares, puts, refusal = self._budget.charge_read(sizes, usage, self._publishes)
        if refusal is not None:
            HUB_PUBLISHES_REFUSED.labels("etcd_budget").inc(len(sizes) - admitted)
        return admitted, compares, puts, refusal
