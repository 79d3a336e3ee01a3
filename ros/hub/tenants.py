"""Tenants: creation (token printed once, only its hash stored), authentication, quotas,
deletion.

Also the hub secret that every replica shares (created once, create-if-absent in etcd), from
which each tenant's rotating read keys derive (`ros.tokens`). A tenant's record holds its
*epoch*, drawn at creation and mixed into its token hash and its read keys: a tenant deleted
and created again under the same name accepts nothing of the old one's.
"""

from __future__ import annotations

import hmac
import json
import secrets
import threading
import time
from dataclasses import asdict, dataclass

from consistency import ops
from consistency.etcd import Etcd
from consistency.keys import Keys
from ros.tokens import (
    READ_KEY_PERIOD,
    ReadKey,
    ReadKeySchedule,
    new_epoch,
    new_tenant_token,
    tenant_of,
    token_hash,
)
from tensorhub.errors import AlreadyExists, InvalidArgument, PermissionDenied, TenantNotFound
from tensorhub.names import validate_name

_CACHE_SECONDS = 5.0  # a tenant record (its token hash, quotas) is re-read this often


@dataclass(frozen=True)
class Quotas:
    """Per-tenant limits. Zero in a request means "the default"."""

    max_models: int = 64
    max_retained_versions: int = 4
    max_sessions: int = 1024
    # etcd budget (`consistency.usage`): live manifest bytes, and publishes per minute
    max_etcd_bytes: int = 256 << 20
    max_publishes_per_minute: int = 600

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if value < 1:
                raise InvalidArgument(f"quota {name} must be at least 1, got {value}")


@dataclass(frozen=True)
class Tenant:
    name: str
    quotas: Quotas
    epoch: str = ""  # none: a tenant created before epochs existed


class TenantStore:
    """Tenant records in etcd, with a short cache so authentication is not an etcd read per call."""

    def __init__(self, etcd: Etcd, keys: Keys, *, read_key_period: float = READ_KEY_PERIOD):
        self._etcd = etcd
        self._keys = keys
        self._lock = threading.Lock()
        self._cache: dict[str, tuple[float, Tenant]] = {}
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
        key = self._keys.tenant_record(name)
        result = self._etcd.txn([ops.absent(key)], [ops.put(key, json.dumps(record))])
        if not result.succeeded:
            raise AlreadyExists(f"tenant {name!r} already exists")
        return token

    def cached(self, token: str) -> Tenant | None:
        """The tenant of a token authenticated within the last few seconds, else None: no
        etcd read, so the hub's event loop may ask (a stream needs no worker for it)."""
        with self._lock:
            cached = self._cache.get(token)
        if cached is not None and cached[0] > time.monotonic():
            return cached[1]
        return None

    def authenticate(self, token: str) -> Tenant:
        """The tenant a token belongs to, or `PermissionDenied`."""
        now = time.monotonic()
        hit = self.cached(token)
        if hit is not None:
            return hit
        name = tenant_of(token)
        try:
            key = self._keys.tenant_record(name)
        except InvalidArgument as exc:
            raise PermissionDenied("unknown tenant token") from exc
        kv, _ = self._etcd.get(key)
        if kv is None:
            raise PermissionDenied("unknown tenant token")
        record = json.loads(kv.value)
        epoch = str(record.get("epoch", ""))
        if not hmac.compare_digest(str(record["token_sha256"]), token_hash(token, epoch)):
            raise PermissionDenied("unknown tenant token")
        tenant = Tenant(name, Quotas(**record["quotas"]), epoch)
        with self._lock:
            self._cache[token] = (now + _CACHE_SECONDS, tenant)
        return tenant

    def hub_secret(self) -> bytes:
        """The replicas' shared secret: read if present, else created (create-if-absent)."""
        if self._secret is None:
            key = self._keys.hub_secret()
            candidate = secrets.token_bytes(32)
            result = self._etcd.txn([ops.absent(key)], [ops.put(key, candidate)], [ops.get(key)])
            if result.succeeded:
                self._secret = candidate
            else:
                self._secret = bytes(result.responses[0].response_range.kvs[0].value)
        return self._secret

    def delete(self, name: str, timeout: float) -> int:
        """Delete a tenant: its record and everything under its prefix (models, versions,
        holders, pins, session marks, quota fences) in one transaction, then revoke its
        sessions' leases so their holders stop serving. Returns the revision of the delete.

        Its tokens stop authenticating at once on this replica, and within the
        authentication cache's 5 s on the others. `TenantNotFound` if there is none.
        """
        record = self._keys.tenant_record(name)
        sessions = self._etcd.range(self._keys.sessions(name), prefix=True, timeout=timeout)
        result = self._etcd.txn(
            [ops.exists(record)],
            [ops.delete(record), ops.delete(self._keys.tenant(name), prefix=True)],
            timeout=timeout,
        )
        if not result.succeeded:
            raise TenantNotFound(f"no tenant {name!r}")
        with self._lock:
            for token in [t for t, (_, tenant) in self._cache.items() if tenant.name == name]:
                del self._cache[token]
        for kv in sessions.kvs:  # bounded by the tenant's session quota
            self._etcd.lease_revoke(kv.lease, timeout=timeout)
        return result.revision

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
