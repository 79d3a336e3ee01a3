"""A tenant's etcd budget at Publish: refuse before any write, then charge in the publish's
own transaction (`consistency.usage`: live manifest bytes and publishes per minute, from the
tenant's `Quotas`); for a batch of shards, once per batch. `Budgets` is what the version
handlers receive: the budget and the models quota of a publish, over the replica's etcd."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from consistency import Etcd, Keys, ops
from consistency.layout_records import MAX_BLOCK_SET_BYTES
from consistency.manifests import INLINE_BYTES, SHARD_INLINE_BYTES
from consistency.publishing import Admit, Charge
from consistency.quota import CountedCreate
from consistency.shard_state import arrivals
from consistency.usage import Guard, TenantBudget, UsageCache, shard_tokens
from consistency.versions import VersionRegistry
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
    inline: int,
    cache: UsageCache | None = None,
) -> TenantBudget:
    """The tenant's quotas as a `TenantBudget`; `inline`: the manifest size up to which a
    charge writes it once into etcd's history (`consistency.usage.history_cost`)."""
    return TenantBudget(
        etcd, keys, tenant.name,
        max_bytes=tenant.quotas.max_etcd_bytes,
        publishes_per_minute=tenant.quotas.max_publishes_per_minute,
        history_bytes=tenant.quotas.max_history_bytes,
        history_period=history_period,
        inline=inline,
        cache=cache,
    )  # fmt: skip


def layout_budget(
    etcd: Etcd, keys: Keys, tenant: Tenant, history_period: float, cache: UsageCache
) -> TenantBudget:
    """The tenant's budget as the layout registry charges it for each block set's key it
    creates (`consistency.layouts`): the key's bytes plus `RECORD_BYTES`, live and in the
    history bucket (the key is written once: `inline` past any block set), no publish token."""
    return _budget(etcd, keys, tenant, history_period, MAX_BLOCK_SET_BYTES, cache)


def publish_charge(
    etcd: Etcd,
    keys: Keys,
    tenant: Tenant,
    size: int,
    shard_count: int,
    timeout: float,
    history_period: float,
    cache: UsageCache | None = None,
    arrived: int = 0,
) -> Charge:
    """Check that a publish of a `size`-byte manifest (a whole version with `shard_count`
    0; else one shard of `shard_count`, arriving after `arrived` others of its version, so
    taking `shard_tokens(arrived, 1)` tokens) fits the tenant's budget now, else
    `QuotaExceeded` with nothing written; returns the charge its transaction adds (it
    checks again, race-free). `history_period`: the compactor's interval, over which the
    history budget refills; `cache`: the replica's usage cache
    (`consistency.usage.UsageCache`): the check and the charge read the usage key only when
    it holds no copy, or after a failed transaction."""
    inline = SHARD_INLINE_BYTES if shard_count else INLINE_BYTES
    budget = _budget(etcd, keys, tenant, history_period, inline, cache)
    tokens = float(shard_tokens(arrived, 1)) if shard_count else 1.0
    charge = _Counted(budget.charge_for(size, tokens))
    charge(timeout)
    return charge


class Budgets:
    """A replica's checks of a publish against its tenant's quotas, before any write: the
    etcd budget (`publish_charge`) and the models quota's admission (`CountedCreate`).
    `history_period`: the compactor's interval; `cache`: the replica's usage cache."""

    def __init__(self, etcd: Etcd, keys: Keys, history_period: float, cache: UsageCache) -> None:
        self._etcd = etcd
        self._keys = keys
        self._history_period = history_period
        self._cache = cache

    def whole(self, tenant: Tenant, size: int, timeout: float) -> Charge:
        """`publish_charge` of a whole version, against the replica's cached usage."""
        return publish_charge(
            self._etcd, self._keys, tenant, size, 0, timeout, self._history_period, self._cache
        )

    def shard(
        self, tenant: Tenant, model: str, version: int, size: int, shard_count: int, timeout: float
    ) -> Charge:
        """`publish_charge` of one shard, arriving after those of its version committed so
        far (one read of the version's counter)."""
        arrived = arrivals(self._etcd, self._keys, tenant.name, model, version, timeout)
        return publish_charge(
            self._etcd, self._keys, tenant, size, shard_count, timeout, self._history_period,
            arrived=arrived,
        )  # fmt: skip

    def admission(self, tenant: Tenant, versions: VersionRegistry, model: str) -> Admit:
        """The models quota's admission of a publish of `model`: what its transaction
        compares and writes so that a new model counts against `max_models`."""
        quota = self._models_quota(tenant, versions)

        def admit(remaining: float) -> tuple[list[ops.Cmp], list[ops.Op]]:
            return quota.admit(remaining, model)

        return admit

    def admission_of(
        self, tenant: Tenant, versions: VersionRegistry, names: Sequence[str]
    ) -> Callable[[float], Guard]:
        """The models quota's admission of a publish of a model and its view models
        (docs/views.md): those not yet models of the tenant count against `max_models`, and
        the fence is put once, in place of the model's own admission."""
        quota = self._models_quota(tenant, versions)
        return lambda remaining: quota.admit_names(remaining, list(names))

    def _models_quota(self, tenant: Tenant, versions: VersionRegistry) -> CountedCreate:
        """The tenant's `max_models`, counted by the models its registry lists, fenced by
        one key that every publish creating a model puts."""
        return CountedCreate(
            self._etcd,
            self._keys.quota_fence(tenant.name, "models"),
            tenant.quotas.max_models,
            lambda t: versions.models(tenant.name, timeout=t),
            f"models of tenant {tenant.name}",
        )


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
    """The charge of a batch of one version's shards (`consistency.shard_guards.Budget`):
    one compare and put for the batch, against the usage the batch read. The batch's
    shards arrive as its version's shards number `arrived` on, in batch order, and take
    the publish-rate tokens `consistency.usage.shard_tokens` gives each arrival: a version
    of N shards takes ceil(N / `SHARDS_PER_TOKEN`) however they are batched. Its refusals
    are counted by the batch (`ros.hub.shard_publish`), once each, where the usage was read:
    a batch tried on a carried state decides again on its read."""

    def __init__(self, etcd: Etcd, keys: Keys, tenant: Tenant, history_period: float) -> None:
        self._budget = _budget(etcd, keys, tenant, history_period, SHARD_INLINE_BYTES)
        self.key = self._budget.key

    def charge(
        self, sizes: Sequence[int], usage: ops.KV | None, arrived: int
    ) -> tuple[int, list[ops.Cmp], list[ops.Op], QuotaExceeded | None]:
        tokens = [float(shard_tokens(arrived + i, 1)) for i in range(len(sizes))]
        return self._budget.charge_read(sizes, usage, tokens)
