"""Tenant tokens and read tokens.

Tenant tokens look like `{tenant}.{secret}`; etcd stores only the SHA-256 of the whole token,
so a leaked etcd snapshot reveals no usable token. Read tokens are HMAC-SHA256 over
(tenant, model, version, expiry) with the tenant's read key, which the hub derives from its
own secret and hands to the tenant's clients when they open a session. A holder verifies with
its tenant's key, so a token issued to another tenant (or for another version, or expired)
is refused on the holder's port too.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
import time

from tensorhub.errors import PermissionDenied
from tensorhub.names import validate_name

TOKEN_BYTES = 32
READ_TOKEN_TTL = 300.0


def new_tenant_token(tenant: str) -> str:
    return f"{validate_name(tenant, 'tenant')}.{secrets.token_urlsafe(TOKEN_BYTES)}"


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def tenant_of(token: str) -> str:
    """The tenant a token names (not yet verified)."""
    tenant, sep, secret = token.partition(".")
    if not sep or not secret:
        raise PermissionDenied("malformed token")
    return tenant


def read_key(hub_secret: bytes, tenant: str) -> bytes:
    """The per-tenant key for read tokens, derived from the hub's secret."""
    return hmac.new(hub_secret, b"read-key\0" + tenant.encode(), hashlib.sha256).digest()


def _message(tenant: str, model: str, version: int, expiry: int) -> bytes:
    return b"\0".join([tenant.encode(), model.encode(), struct.pack(">qq", version, expiry)])


def issue_read_token(
    key: bytes, tenant: str, model: str, version: int, ttl: float = READ_TOKEN_TTL
) -> tuple[bytes, int]:
    """A read token for one version, and its expiry (unix seconds)."""
    expiry = int(time.time() + ttl)
    mac = hmac.new(key, _message(tenant, model, version, expiry), hashlib.sha256).digest()
    return struct.pack(">q", expiry) + mac, expiry


class ReadTokenVerifier:
    """The check a holder's data-plane server runs on every read request."""

    def __init__(self, key: bytes, tenant: str) -> None:
        self._key = key
        self._tenant = tenant

    def __call__(self, tenant: str, model: str, version: int, token: bytes) -> bool:
        if tenant != self._tenant or len(token) != 8 + 32:
            return False
        (expiry,) = struct.unpack(">q", token[:8])
        if expiry < time.time():
            return False
        expected = hmac.new(self._key, _message(tenant, model, version, expiry), hashlib.sha256)
        return hmac.compare_digest(expected.digest(), token[8:])
