"""Tenant tokens and read tokens.

**Tenant tokens** look like `{tenant}.{secret}`. The secret is URL-safe base64
(`[A-Za-z0-9_-]`), which never contains `.`, so the tenant is everything before the LAST
`.`: unambiguous although tenant names may contain dots (`team.x`). etcd stores only a
SHA-256 of the token, mixed with the tenant's *epoch* (a random value drawn when the tenant
is created), so a leaked etcd snapshot reveals no usable token, and a tenant deleted and
created again under the same name is a new tenant: nothing of the old one's verifies
against it.

**Read tokens** are HMAC-SHA256 over (tenant, model, version, expiry, key id) with one of
the tenant's *read keys*. A read key is derived, without any state, from the hub's secret,
the tenant, its epoch and a rotation period number:
`HMAC(hub_secret, "read-key" | tenant | epoch | period)`, a new period every
`READ_KEY_PERIOD` seconds (1 h; the hub's `--read-key-period`), so every replica derives the
same keys. A token carries its key's id (the period number):

- Clients learn keys only under a live session of their own (OpenSession, then every
  KeepAlive answer): the keys of the current and the previous period.
- The hub signs with the key of the period that began at least half a period ago, so a
  holder that renewed its session within that half period (sessions renew every TTL / 3,
  at most 100 s apart) always knows the signing key, and a token stays verifiable at least
  half a period after it was issued: reads in flight survive a rotation.
- Holders accept only the keys of their last KeepAlive answer, and only tokens that
  expire within `MAX_READ_TOKEN_LIFETIME` (twice `READ_TOKEN_TTL`, 10 min) of now.

So a client that is no longer in session (or whose tenant was deleted) can mint tokens its
holders accept for at most two periods after its last KeepAlive answer, each token for at
most `MAX_READ_TOKEN_LIFETIME`.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import re
import secrets
import struct
import time
from collections.abc import Iterable
from dataclasses import dataclass

from tensorhub.errors import InvalidArgument, PermissionDenied
from tensorhub.names import validate_name

TOKEN_BYTES = 32
SEPARATOR = "."  # between tenant and secret; the secret never contains it
READ_TOKEN_TTL = 300.0  # what the hub issues at Resolve
MAX_READ_TOKEN_LIFETIME = 2 * READ_TOKEN_TTL  # the furthest expiry a holder accepts
READ_KEY_PERIOD = 3600.0  # a tenant's read key rotates this often (seconds)
MIN_READ_KEY_PERIOD = 1.0
_SECRET_RE = re.compile(r"[A-Za-z0-9_-]+")
_TOKEN_HEADER = struct.Struct(">qq")  # expiry (unix seconds), key id (period number)
READ_TOKEN_BYTES = _TOKEN_HEADER.size + 32


def new_tenant_token(tenant: str) -> str:
    """A fresh token for `tenant`: `{tenant}.{secret}`."""
    return f"{validate_name(tenant, 'tenant')}{SEPARATOR}{secrets.token_urlsafe(TOKEN_BYTES)}"


def new_epoch() -> str:
    """A tenant's epoch: drawn at creation, so a re-created tenant shares no key with the old."""
    return secrets.token_hex(16)


def token_hash(token: str, epoch: str = "") -> str:
    """What etcd stores of a token: SHA-256 of it, with the tenant's epoch (none: the admin
    token, and tenants created before epochs existed)."""
    data = f"{epoch}\0{token}" if epoch else token
    return hashlib.sha256(data.encode()).hexdigest()


def tenant_of(token: str) -> str:
    """The tenant a token names (not yet verified): everything before the last `.`."""
    tenant, sep, secret = token.rpartition(SEPARATOR)
    if not sep or not tenant or _SECRET_RE.fullmatch(secret) is None:
        raise PermissionDenied("malformed token")
    return tenant


@dataclass(frozen=True)
class ReadKey:
    """One of a tenant's read keys: `id` is its rotation period's number."""

    id: int
    key: bytes


def read_key(hub_secret: bytes, tenant: str, epoch: str, period_id: int) -> ReadKey:
    """The tenant's read key for one period, derived from the hub's secret."""
    message = b"\0".join(
        [b"read-key", tenant.encode(), epoch.encode(), struct.pack(">q", period_id)]
    )
    return ReadKey(period_id, hmac.new(hub_secret, message, hashlib.sha256).digest())


class ReadKeySchedule:
    """Which read keys a tenant has at a given time, for one hub secret and period."""

    def __init__(self, hub_secret: bytes, period: float = READ_KEY_PERIOD) -> None:
        if not math.isfinite(period) or period < MIN_READ_KEY_PERIOD:
            raise InvalidArgument(
                f"read key period must be at least {MIN_READ_KEY_PERIOD} s, got {period}"
            )
        self._secret = hub_secret
        self.period = period

    def current(self, tenant: str, epoch: str, now: float | None = None) -> list[ReadKey]:
        """The keys a holder accepts now: the current period's and the previous one's."""
        period = int((time.time() if now is None else now) // self.period)
        return [read_key(self._secret, tenant, epoch, p) for p in (period, period - 1)]

    def signing(self, tenant: str, epoch: str, now: float | None = None) -> ReadKey:
        """The key tokens are signed with now: of the period that began at least half a
        period ago, which every holder renewing within half a period already has."""
        at = (time.time() if now is None else now) - self.period / 2
        return read_key(self._secret, tenant, epoch, int(at // self.period))


def _message(tenant: str, model: str, version: int, expiry: int, key_id: int) -> bytes:
    return b"\0".join(
        [tenant.encode(), model.encode(), struct.pack(">qqq", version, expiry, key_id)]
    )


def issue_read_token(
    key: ReadKey, tenant: str, model: str, version: int, ttl: float = READ_TOKEN_TTL
) -> tuple[bytes, int]:
    """A read token for one version, and its expiry (unix seconds)."""
    expiry = int(time.time() + ttl)
    mac = hmac.new(key.key, _message(tenant, model, version, expiry, key.id), hashlib.sha256)
    return _TOKEN_HEADER.pack(expiry, key.id) + mac.digest(), expiry


class ReadTokenVerifier:
    """The check a holder's data-plane server runs on every read request.

    It accepts the keys it was last given (`update`: the SDK passes every KeepAlive answer's
    keys, so a long-lived holder follows rotation), and only tokens whose expiry is in the
    future but within `max_lifetime` of now.
    """

    def __init__(
        self,
        keys: Iterable[ReadKey],
        tenant: str,
        max_lifetime: float = MAX_READ_TOKEN_LIFETIME,
    ) -> None:
        self._tenant = tenant
        self._max_lifetime = max_lifetime
        self._keys: dict[int, bytes] = {}
        self.update(keys)

    def update(self, keys: Iterable[ReadKey]) -> None:
        """Accept exactly these keys from now on (one reference swap: thread-safe)."""
        self._keys = {k.id: k.key for k in keys}

    @property
    def key_ids(self) -> list[int]:
        return sorted(self._keys)

    def __call__(self, tenant: str, model: str, version: int, token: bytes) -> bool:
        if tenant != self._tenant or len(token) != READ_TOKEN_BYTES:
            return False
        expiry, key_id = _TOKEN_HEADER.unpack(token[: _TOKEN_HEADER.size])
        now = time.time()
        if expiry < now or expiry - now > self._max_lifetime:
            return False  # expired, or minted to outlive what the hub ever issues
        key = self._keys.get(key_id)
        if key is None:
            return False  # rotated out (or never ours)
        expected = hmac.new(key, _message(tenant, model, version, expiry, key_id), hashlib.sha256)
        return hmac.compare_digest(expected.digest(), token[_TOKEN_HEADER.size :])
