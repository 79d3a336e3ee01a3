"""Tenants: creation (token printed once, only its hash stored), authentication, quotas,
deletion.

Also the hub secret that every replica shares (created once, create-if-absent in etcd), from
which each tenant's rotating read keys derive (`ros.tokens`). A tenant's record holds its
*epoch*, drawn at creation and mixed into its token hash and its read keys: a tenant deleted
and created again under the same name accepts nothing of the old one's.
"""

from __future__ import annotations

import hmac
import logging
import secrets
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

from consistency.etcd import Etcd, Fence
from consistency.keys import Keys
from consistency.tenant_records import TenantRecords
from ros.metrics import HUB_TENANT_RECORD_READS, HUB_UNKNOWN_TOKENS_REFUSED
from ros.tokens import (
    READ_KEY_PERIOD,
    ReadKey,
    ReadKeySchedule,
    new_epoch,
    new_tenant_token,
    tenant_of,
    token_hash,
)
from tensorhub.errors import (
    AlreadyExists,
    DeadlineExceeded,
    InvalidArgument,
    Overloaded,
    PermissionDenied,
    TenantNotFound,
    TensorHubError,
)
from tensorhub.lru import SizedLru
from tensorhub.names import validate_name

log = logging.getLogger(__name__)

_CACHE_SECONDS = 5.0  # a tenant record (its token hash, quotas) is re-read this often
_MISSING_SECONDS = 1.0  # a name found missing is refused from memory this long
MAX_UNKNOWN_LOOKUPS = 2  # etcd reads at once for tenant names this replica has never seen
MAX_MISSING_NAMES = 65_536
_LOOKUP_SECONDS = 10.0  # deadline of one tenant-record read


@dataclass(frozen=True)
class _Record:
    record: dict[str, Any]
    expires: float  # time.monotonic()

    def fresh(self) -> bool:
        return self.expires > time.monotonic()


class _Lookup:
    """One etcd read of a tenant record in flight, and what it found."""

    def __init__(self, unknown: bool) -> None:
        self.unknown = unknown  # holds one of the places for never-seen names
        self.done = threading.Event()
        self.record: dict[str, Any] | None = None
        self.error: TensorHubError | None = None


@dataclass(frozen=True)
class Quotas:
    """Per-tenant limits. Zero in a request means "the default"."""

    max_models: int = 64
    max_retained_versions: int = 4
    max_sessions: int = 1024
    # etcd budget (`consistency.usage`): live manifest bytes, and publishes per minute
    max_etcd_bytes: int = 256 << 20
    max_publishes_per_minute: int = 600
    # etcd history the tenant's publishes may write per compaction interval (a bucket)
    max_history_bytes: int = 256 << 20

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if value < 1:
                raise InvalidArgument(f"quota {name} must be at least 1, got {value}")


@dataclass(frozen=True)
class Tenant:
    """An authenticated tenant: its name, quotas, epoch, and `created`, the create revision
    of its record, which every write made for it compares (`fence`)."""

    name: str
    quotas: Quotas
    epoch: str = ""  # none: a tenant created before epochs existed
    created: int = 0  # 0: not read from etcd (then nothing is fenced)


class TenantStore:
    """Tenant records in etcd, with a short cache so authentication is not an etcd read per call.

    Every etcd request, and the decoding of the records, is `consistency.tenant_records`'s."""

    def __init__(self, etcd: Etcd, keys: Keys, *, read_key_period: float = READ_KEY_PERIOD):
        self._records_db = TenantRecords(etcd, keys)
        self._lock = threading.Lock()
        self._cache: dict[str, tuple[float, Tenant]] = {}  # valid tokens only
        # Tenant records by name (real tenants only: bounded by what the admin created),
        # names recently found missing (bounded: made-up names), and the bound on reads of
        # names never seen (see `authenticate`).
        self._records: dict[str, _Record] = {}
        # Names read as real tenants. Not an authority (nothing is authenticated from it):
        # it only keeps a known tenant out of the bound on never-seen names after its record
        # is dropped from `_records` (its record changed, the watch had a gap), so a flood of
        # made-up names cannot refuse it. Real tenants only; a read finding none removes one.
        self._seen: set[str] = set()
        self._missing: SizedLru[str, float] = SizedLru(MAX_MISSING_NAMES, lambda _: 1)
        self._unknown = threading.BoundedSemaphore(MAX_UNKNOWN_LOOKUPS)
        self._inflight: dict[str, _Lookup] = {}  # by name: concurrent callers share one read
        self._secret: bytes | None = None
        self._read_key_period = read_key_period
        self._schedule: ReadKeySchedule | None = None

    def create(self, name: str, quotas: Quotas | None = None) -> str:
        """Create a tenant; returns its token (shown once: only the hash is stored)."""
        validate_name(name, "tenant")
        token, epoch = new_tenant_token(name), new_epoch()
        record = {
            "token_sha256": token_hash(token, epoch),
            "epoch": epoch,
            "quotas": asdict(quotas or Quotas()),
        }
        if not self._records_db.create(name, record):
            raise AlreadyExists(f"tenant {name!r} already exists")
        # A name probed just before it existed is not refused from memory here; another
        # replica that probed it refuses it for at most `_MISSING_SECONDS` more.
        self._missing.pop(name)
        return token

    def cached(self, token: str) -> Tenant | None:
        """The tenant of `token` from memory alone, or None if that needs an etcd read; no
        I/O, so the hub's event loop may ask (a stream needs no worker for it). Raises
        `PermissionDenied` for a token memory can already refuse: malformed, a wrong secret
        for a tenant whose record is fresh, or a name recently found not to exist."""
        with self._lock:
            cached = self._cache.get(token)
        if cached is not None and cached[0] > time.monotonic():
            return cached[1]
        name = tenant_of(token)
        record = self._records.get(name)
        if record is not None and record.fresh():
            return self._check(token, name, record.record)
        missing = self._missing.get(name)
        if missing is not None and missing > time.monotonic():
            raise PermissionDenied("unknown tenant token")
        return None

    def authenticate(self, token: str) -> Tenant:
        """The tenant a token belongs to, or `PermissionDenied`.

        Authentication reads etcd only for a tenant record this replica does not have
        fresh, and callers asking for the same name at once share one read. Names this
        replica has never read as a tenant (every token an attacker makes up) are read at
        most `MAX_UNKNOWN_LOOKUPS` at a time, past which a caller is `Overloaded` at once (a
        tenant read once is not, even after its record left the cache), and a name found
        missing is refused from memory for `_MISSING_SECONDS`. So a flood of made-up tokens
        costs a few etcd reads at a time, and the worker pool keeps serving the tenants it
        knows.
        """
        hit = self.cached(token)
        if hit is not None:
            return hit
        name = tenant_of(token)
        try:
            self._records_db.check_name(name)
        except InvalidArgument as exc:
            raise PermissionDenied("unknown tenant token") from exc
        record = self._lookup(name)
        if record is None:
            raise PermissionDenied("unknown tenant token")
        return self._check(token, name, record)

    def _lookup(self, name: str) -> dict[str, Any] | None:
        """Read one tenant's record, once for all callers asking for it at the same time;
        names never seen take one of `MAX_UNKNOWN_LOOKUPS` places (else `Overloaded`)."""
        with self._lock:
            pending = self._inflight.get(name)
            mine = pending is None
            if pending is None:
                unknown = name not in self._seen
                if unknown and not self._unknown.acquire(blocking=False):
                    HUB_UNKNOWN_TOKENS_REFUSED.inc()
                    raise Overloaded(
                        f"this hub replica is checking {MAX_UNKNOWN_LOOKUPS} tokens of tenants "
                        "it does not know yet: retry shortly"
                    )
                pending = self._inflight[name] = _Lookup(unknown)
        if not mine:
            if not pending.done.wait(_LOOKUP_SECONDS):
                raise DeadlineExceeded(
                    f"reading tenant {name!r}'s record took over {_LOOKUP_SECONDS}s"
                )
            if pending.error is not None:
                raise pending.error
            return pending.record
        try:
            pending.record = self._read_record(name)
            return pending.record
        except TensorHubError as exc:
            pending.error = exc
            raise
        finally:
            with self._lock:
                del self._inflight[name]
            if pending.unknown:
                self._unknown.release()
            pending.done.set()

    def _read_record(self, name: str) -> dict[str, Any] | None:
        """Read a tenant record from etcd into the caches (None: there is no such tenant);
        its `created` is the fence of its writes (`Tenant.created`)."""
        HUB_TENANT_RECORD_READS.inc()
        record = self._records_db.read(name)
        if record is None:
            with self._lock:
                self._records.pop(name, None)
                self._seen.discard(name)
            self._missing.put(name, time.monotonic() + _MISSING_SECONDS)
            return None
        with self._lock:
            self._records[name] = _Record(record, time.monotonic() + _CACHE_SECONDS)
            self._seen.add(name)
        self._missing.pop(name)
        return record

    def _check(self, token: str, name: str, record: dict[str, Any]) -> Tenant:
        epoch = str(record.get("epoch", ""))
        if not hmac.compare_digest(str(record["token_sha256"]), token_hash(token, epoch)):
            raise PermissionDenied("unknown tenant token")
        quotas = dict(record["quotas"])
        # a record written before the history budget: as much history as live bytes
        quotas.setdefault("max_history_bytes", quotas.get("max_etcd_bytes", Quotas.max_etcd_bytes))
        tenant = Tenant(name, Quotas(**quotas), epoch, int(record.get("created", 0)))
        with self._lock:
            self._cache[token] = (time.monotonic() + _CACHE_SECONDS, tenant)
        return tenant

    def hub_secret(self) -> bytes:
        """The replicas' shared secret: read if present, else created (create-if-absent)."""
        if self._secret is None:
            self._secret = self._records_db.secret(secrets.token_bytes(32))
        return self._secret

    def overcommit(self, quota_bytes: int, period: float, timeout: float) -> str:
        """Whether every tenant's etcd budget together fits in etcd's quota (`quota_bytes`,
        its `--quota-backend-bytes`): "" if so, else a sentence saying by how much not.

        A tenant can hold `max_etcd_bytes` live and, between two compactions (one `period`
        and a poll), write up to twice `max_history_bytes` of history (a full bucket, then
        one interval's refill). What etcd keeps besides (holder, session and pin records,
        bounded by the session quota) is left out, so the sum must leave room for them."""
        listed = self._records_db.quotas(timeout)
        total = 0
        for quotas in listed:
            live = int(quotas.get("max_etcd_bytes", Quotas.max_etcd_bytes))
            total += live + 2 * int(quotas.get("max_history_bytes", live))
        if total <= quota_bytes:
            return ""
        return (
            f"the {len(listed)} tenants' etcd budgets add up to {total} bytes (live bytes "
            f"plus twice the history each may write per {period:g} s compaction interval), "
            f"more than etcd's quota of {quota_bytes} bytes (--etcd-quota-bytes): together "
            "they can fill etcd (NOSPACE refuses every tenant's writes). Lower "
            "--max-etcd-bytes or --max-history-bytes, or raise etcd's --quota-backend-bytes"
        )

    def fence(self, tenant: Tenant) -> Fence | None:
        """What every write made for `tenant` compares: its record's create revision, as it
        was when the caller authenticated. A write racing the tenant's deletion either lands
        before the delete (which then removes it) or is refused after it, with
        `PermissionDenied`, on every replica at once, whatever any cache says."""
        if not tenant.created:
            return None
        name = tenant.name

        def refusal() -> PermissionDenied:
            self.forget(name)
            return PermissionDenied(f"tenant {name!r} was deleted: its token is no longer valid")

        return self._records_db.fence(name, tenant.created, refusal)

    def forget(self, name: str) -> None:
        """Drop everything remembered about tenant `name`: its record, its tokens, and that
        it was found missing (it may just have been created)."""
        with self._lock:
            for token in [t for t, (_, tenant) in self._cache.items() if tenant.name == name]:
                del self._cache[token]
            self._records.pop(name, None)
        self._missing.pop(name)

    def forget_all(self) -> None:
        with self._lock:
            self._cache.clear()
            self._records.clear()

    def delete(self, name: str, timeout: float) -> int:
        """Delete a tenant: its record and everything under its prefix (models, versions,
        holders, pins, session marks, quota fences) in one transaction, then revoke the
        leases of the sessions it had. Returns the revision of the delete.

        The same transaction lists the session marks before deleting them, so every session
        marked up to the delete is revoked, and every write made for the tenant compares its
        record's create revision (`fence`): one that commits after the delete is refused, one
        that committed before is removed by it. A session opened meanwhile is either listed
        or refused its mark (and its lease revoked by the refused open). Its tokens stop
        authenticating at once on this replica, and on the others when their watch of the
        tenant records tells them (`watch`), within the authentication cache's 5 s at most.
        `TenantNotFound` if there is none.
        """
        deleted = self._records_db.delete(name, timeout)
        if deleted is None:
            raise TenantNotFound(f"no tenant {name!r}")
        self.forget(name)
        with self._lock:
            self._seen.discard(name)  # a tenant no more: its name counts as never seen again
        self._records_db.revoke(deleted.leases, timeout)
        return deleted.revision

    def watch(self, stop: threading.Event) -> None:
        """Keep this replica's caches true to the tenant records until `stop`: a change to
        a tenant's record (deleted, created again, quotas edited) drops what is cached about
        it at once, and a gap in the watch (a compaction, a reconnect) drops everything.
        Runs in the caller's thread (the hub starts one); a failure drops every cache, then
        the watch starts again from the present after a second."""
        while not stop.is_set():
            try:
                self._records_db.follow(stop, self.forget, self.forget_all)
            except Exception as exc:  # whatever broke, caches must not outlive it
                self.forget_all()
                if stop.is_set():
                    return
                log.warning("watch of the tenant records failed (%s); caches dropped", exc)
                stop.wait(1.0)

    def _read_keys(self) -> ReadKeySchedule:
        if self._schedule is None:
            self._schedule = ReadKeySchedule(self.hub_secret(), self._read_key_period)
        return self._schedule

    def read_keys(self, tenant: Tenant) -> list[ReadKey]:
        """The read keys a holder of `tenant` accepts now (current period first): what a
        live session of the tenant learns at OpenSession and in every KeepAlive answer."""
        return self._read_keys().current(tenant.name, tenant.epoch)

    def signing_key(self, tenant: Tenant) -> ReadKey:
        """The key the hub signs `tenant`'s read tokens with now (see `ros.tokens`)."""
        return self._read_keys().signing(tenant.name, tenant.epoch)
