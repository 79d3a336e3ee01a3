"""A verifier that accepts every token, for benchmarks of the data plane on its own (a
holder served without a hub: no read token to check)."""

from __future__ import annotations


def allow_all(tenant: str, model: str, version: int, token: bytes) -> bool:
    """Accept every request."""
    return True
