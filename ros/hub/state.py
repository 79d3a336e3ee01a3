"""What every handler group of a hub replica shares: etcd, the tenant store, the worker
pools, the caches and the shared watches; and the few operations they all need
(authentication, deadlines, the tenant's registries).

One `HubState` per replica, passed to each handler group (`ros.hub.rpc_sessions`,
`rpc_publish`, `rpc_versions`, `rpc_listing`, `rpc_holders`, `rpc_models`, `rpc_tenants`,
`rpc_layouts`) and to the servicer that delegates to them. Constructing it does no I/O and
starts no thread; `start()` does both (the hub secret, the tenant-records watch), `close()`
undoes them.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from consistency import Etcd, HolderRegistry, Keys, VersionRegistry
from consistency.declared_layouts import DeclaredLayouts
from consistency.keepalive import LeaseKeeper
from consistency.layouts import LayoutRegistry
from consistency.parts_sums import PartsSums
from consistency.sessions import SessionRecords
from consistency.usage import DEFAULT_HISTORY_PERIOD, UsageCache
from ros.hub.budget import Budgets, layout_budget
from ros.hub.call import ADMIN, MAX_CALL_SECONDS, CallContext, Caller, as_named, bearer, same
from ros.hub.fanout import WatchFanout
from ros.hub.holder_index import HolderIndex
from ros.hub.limits import Limits, StreamLimits
from ros.hub.manifest_cache import ManifestCache
from ros.hub.manifest_processes import ManifestProcesses
from ros.hub.model_feed import ModelFeeds
from ros.hub.session_marks import SessionMarks
from ros.hub.shard_publish import ShardBatches
from ros.hub.tenants import Tenant, TenantStore
from ros.tokens import MAX_READ_TOKEN_LIFETIME, READ_KEY_PERIOD, READ_TOKEN_TTL, token_hash
from tensorhub.errors import (
    DeadlineExceeded,
    InvalidArgument,
    PermissionDenied,
)
from tensorhub.lru import SizedLru

DEFAULT_ETCD_QUOTA_BYTES = 2 << 30  # etcd's own default --quota-backend-bytes
MAX_OPENED_SESSIONS = 65_536  # session ids remembered per replica (see `opened_sessions`)
MAX_REGISTRIES = 4096  # tenants whose registries are kept built (one each)
T = TypeVar("T")


class HubState:
    """One replica's shared state (see the module docstring).

    `history_period`: the compactor's interval, over which each tenant's etcd history
    budget refills; `etcd_quota_bytes`: etcd's `--quota-backend-bytes`, which CreateTenant
    checks the tenants' budgets against; `read_token_ttl`: what Resolve issues.
    """

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
        if not 0 < read_token_ttl <= MAX_READ_TOKEN_LIFETIME:  # holders refuse longer ones
            raise InvalidArgument(
                f"read token TTL must be in (0, {MAX_READ_TOKEN_LIFETIME:g}] s, "
                f"got {read_token_ttl}"
            )
        self.read_token_ttl = read_token_ttl
        self.history_period = history_period if history_period > 0 else DEFAULT_HISTORY_PERIOD
        # Called (on the event loop) when a call was refused for etcd's NOSPACE; the server
        # points it at its compactor, which owns the writes health state.
        self.on_storage_full: Callable[[], None] = lambda: None
        self.etcd_quota_bytes = etcd_quota_bytes
        self.etcd = etcd
        self.keys = keys
        self._admin_hash = token_hash(admin_token)
        self.tenants = TenantStore(etcd, keys, read_key_period=read_key_period)
        self.default_retain = default_retain
        self.limits = limits or Limits()
        self.streams = StreamLimits(self.limits)
        # Every blocking handler body runs here: a fixed number of threads, whatever the load.
        self.workers = ThreadPoolExecutor(
            max_workers=self.limits.workers, thread_name_prefix="hub-worker"
        )
        # Retention runs after a publish has answered, off the publisher's critical path.
        self.collector = ThreadPoolExecutor(max_workers=1, thread_name_prefix="retention")
        # One etcd watch per hot model, on one stream, shared by the Watch fan-out and the
        # holder index (Resolve's view of who holds what: caches only).
        self.feeds = ModelFeeds(etcd)
        self.fanout = WatchFanout(etcd, keys, self.streams, self.feeds)
        self.holder_index = HolderIndex(etcd, keys, feeds=self.feeds)
        self.leases = LeaseKeeper(etcd)
        self.sessions = SessionRecords(etcd, keys)
        self.manifest_cache = ManifestCache()
        # Group calls' manifests checked in processes of their own, beside the loop.
        self.manifest_processes = ManifestProcesses(self.limits.check_processes)
        # The publisher checksums of versions of many shards, added up from their parts once
        # (`consistency.parts_sums`).
        self.parts_sums = PartsSums()
        # The usage keys as this replica last read or wrote them: a publish charges its
        # tenant's budget against them with no read (`consistency.usage.UsageCache`).
        self.usage_cache = UsageCache()
        self.budgets = Budgets(etcd, keys, self.history_period, self.usage_cache)
        # Shard publishes of one version waiting at once commit in one transaction; so do
        # the session marks of one tenant opening at once (a herd of clients). Their
        # transactions run on threads of their own, never queued behind the calls whose
        # writes they carry (one in flight per version or tenant).
        self.committers = ThreadPoolExecutor(
            max_workers=self.limits.workers, thread_name_prefix="hub-commit"
        )
        self.shard_batches = ShardBatches(etcd, keys, self.committers, self.history_period)
        self.session_marks = SessionMarks(self.sessions, self.committers, self.etcd_for)
        # Sessions this replica opened, by id: their tenant is known without an etcd read
        # (a lease never changes tenant), so their first renewal costs no worker. Bounded.
        self.opened_sessions: SizedLru[int, str] = SizedLru(MAX_OPENED_SESSIONS, lambda _: 1)
        # Each tenant's registries, built once per tenant record (see `versions`).
        self._registries: SizedLru[tuple[str, int, int], _Registries] = SizedLru(
            MAX_REGISTRIES, lambda _: 1
        )
        self._stop_tenant_watch = threading.Event()
        self._tenant_watch: threading.Thread | None = None

    def start(self) -> None:
        """Create (or read) the replicas' shared secret now, not in the first caller's
        deadline, start the manifest checking processes (if any), and follow the tenant
        records, so a deleted tenant's cached tokens are dropped at once (writes are fenced
        in etcd regardless: `TenantStore.fence`)."""
        self.tenants.hub_secret()
        self.manifest_processes.start()
        if self._tenant_watch is None:
            self._tenant_watch = threading.Thread(
                target=self.tenants.watch, args=(self._stop_tenant_watch,),
                name="tenant-records", daemon=True,
            )  # fmt: skip
            self._tenant_watch.start()

    def close(self) -> None:
        """Stop the workers, the background retention worker (pending collections are
        dropped: the next publish of each model runs its retention again), the shared
        watches and the lease keepalive stream."""
        self._stop_tenant_watch.set()
        self.workers.shutdown(wait=False, cancel_futures=True)
        self.committers.shutdown(wait=False, cancel_futures=True)
        self.collector.shutdown(wait=False, cancel_futures=True)
        self.fanout.close()
        self.holder_index.close()
        self.feeds.close()
        self.leases.close()
        self.manifest_processes.close()

    # -- running blocking work -------------------------------------------------------------

    async def blocking(
        self, fn: Callable[..., T], *args: Any, deadline_of: CallContext | None = None
    ) -> T:
        """Run `fn(*args)` in the worker pool and await it. With `deadline_of`, refuse to
        start it once that call's deadline has passed (it may have waited in the queue)."""

        def run() -> T:
            if deadline_of is not None:
                _check_deadline(deadline_of)
            return fn(*args)

        if deadline_of is not None:
            _check_deadline(deadline_of)
        return await asyncio.get_running_loop().run_in_executor(self.workers, run)

    @staticmethod
    def timeout(context: CallContext) -> float:
        """Seconds the call may still take: its deadline, capped at `MAX_CALL_SECONDS`."""
        remaining = context.time_remaining()
        if remaining is None:
            return MAX_CALL_SECONDS
        if remaining <= 0:
            raise DeadlineExceeded("the call's deadline passed before the hub could act")
        return min(remaining, MAX_CALL_SECONDS)

    # -- who calls -------------------------------------------------------------------------

    def is_admin(self, token: str) -> bool:
        """Whether `token` is the hub's admin token (compared in constant time)."""
        return same(token_hash(token), self._admin_hash)

    def known(self, call: CallContext) -> Caller | None:
        """The caller from memory alone (no I/O: the event loop may ask), or None if that
        needs an etcd read; `PermissionDenied` for a token memory already refuses."""
        token = bearer(call)
        if token is None:
            raise PermissionDenied("no tenant token: send 'authorization: Bearer <token>'")
        if self.is_admin(token):
            return ADMIN
        cached = self.tenants.cached(token)
        return None if cached is None else as_named(call, cached)

    def authenticate(self, call: CallContext) -> Caller:
        """The caller, reading its tenant record from etcd if memory cannot tell (blocking:
        in a worker); `PermissionDenied` if the token is nobody's."""
        token = bearer(call)
        if token is None:
            raise PermissionDenied("no tenant token: send 'authorization: Bearer <token>'")
        if self.is_admin(token):
            return ADMIN
        return as_named(call, self.tenants.authenticate(token))

    async def caller(self, call: CallContext) -> Caller:
        """The call's caller, for the call guard (`ros.hub.guard.CallGuard`, which hands it
        to the handler): from memory on the loop when it can (thousands of streams opening
        at once do not queue behind unary calls for a worker), else with one etcd read in a
        worker."""
        known = self.known(call)
        if known is not None:
            return known
        return await self.blocking(self.authenticate, call, deadline_of=call)

    # -- the tenant's registries -----------------------------------------------------------

    def versions(self, tenant: Tenant) -> VersionRegistry:
        """The tenant's version registry, every write of which is fenced on its record
        (`TenantStore.fence`)."""
        return self._registries_of(tenant).versions

    def holders(self, tenant: Tenant) -> HolderRegistry:
        """The tenant's holder registry (over its version registry), fenced the same way."""
        return self._registries_of(tenant).holders

    def _registries_of(self, tenant: Tenant) -> _Registries:
        """Built once per tenant record and retention, then reused: a registry holds no
        per-call state. A tenant deleted and created again (another record revision) or
        given another retention quota gets new ones."""
        retain = min(self.default_retain, tenant.quotas.max_retained_versions)
        key = (tenant.name, tenant.created, retain)
        registries = self._registries.get(key)
        if registries is None:
            versions = VersionRegistry(
                self.etcd_for(tenant), self.keys, retain=retain, collector=self.collector,
                usage_cache=self.usage_cache,
            )  # fmt: skip
            registries = _Registries(versions, HolderRegistry(versions))
            self._registries.put(key, registries)
        return registries

    def layouts(self, tenant: Tenant) -> LayoutRegistry:
        """The tenant's layout holder registry (`consistency.layouts`), its writes fenced on
        the tenant's record as the other registries' are."""
        etcd = self.etcd_for(tenant)
        budget = layout_budget(etcd, self.keys, tenant, self.history_period, self.usage_cache)
        return LayoutRegistry(etcd, self.keys, budget, self.parts_sums)

    def declared_layouts(self, tenant: Tenant) -> DeclaredLayouts:
        """The tenant's declared layouts (`consistency.declared_layouts`), its writes fenced
        on the tenant's record."""
        return DeclaredLayouts(self.etcd_for(tenant), self.keys)

    def etcd_for(self, tenant: Tenant) -> Etcd:
        """The etcd connection for writes made on `tenant`'s behalf: each compares that the
        tenant's record is the one it authenticated against (deleted: `PermissionDenied`)."""
        fence = self.tenants.fence(tenant)
        return self.etcd if fence is None else self.etcd.fenced(fence)


@dataclass(frozen=True)
class _Registries:
    """One tenant's registries."""

    versions: VersionRegistry
    holders: HolderRegistry


def _check_deadline(call: CallContext) -> None:
    remaining = call.time_remaining()
    if remaining is not None and remaining <= 0:
        raise DeadlineExceeded("the call's deadline passed before the hub could act")
