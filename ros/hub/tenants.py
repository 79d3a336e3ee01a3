"""Tenants: creation (token printed once, only its hash stored), authentication, quotas.

Also the hub secret that every replica shares (created once, create-if-absent in etcd), from
which each tenant's read-token key derives.
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
from ros.tokens import new_tenant_token, read_key, tenant_of, token_hash
from tensorhub.errors import AlreadyExists, InvalidArgument, PermissionDenied
from tensorhub.names import validate_name

_CACHE_SECONDS = 5.0  # a tenant record (its token hash, quotas) is re-read this often


@dataclass(frozen=True)
class Quotas:
    """Per-tenant limits. Zero in a request means "the default"."""

    max_models: int = 64
    max_retained_versions: int = 4
    max_sessions: int = 1024

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if value < 1:
                raise InvalidArgument(f"quota {name} must be at least 1, got {value}")


@dataclass(frozen=True)
class Tenant:
    name: str
    quotas: Quotas


class TenantStore:
    """Tenant records in etcd, with a short cache so authentication is not an etcd read per call."""

    def __init__(self, etcd: Etcd, keys: Keys) -> None:
        self._etcd = etcd
        self._keys = keys
        self._lock = threading.Lock()
        self._cache: dict[str, tuple[float, Tenant]] = {}
        self._secret: bytes | None = None

    def create(self, name: str, quotas: Quotas | None = None) -> str:
        """Create a tenant; returns its token (shown once: only the hash is stored)."""
        validate_name(name, "tenant")
        token = new_tenant_token(name)
        record = {"token_sha256": token_hash(token), "quotas": asdict(quotas or Quotas())}
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
        if not hmac.compare_digest(str(record["token_sha256"]), token_hash(token)):
            raise PermissionDenied("unknown tenant token")
        tenant = Tenant(name, Quotas(**record["quotas"]))
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

    def read_key(self, tenant: str) -> bytes:
        return read_key(self.hub_secret(), tenant)
