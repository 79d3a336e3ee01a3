"""The read-token check every holder channel runs before it serves or shares any memory.

A `Verifier` says whether `token` may read tenant/model@version. The TCP data port, the
RDMA control channel and the same-host IPC channel all ask it through `token_allowed`, so a
verifier that raises is refused, and logged, the same way on each.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

log = logging.getLogger(__name__)

Verifier = Callable[[str, str, int, bytes], bool]
"""(tenant, model, version, token) -> whether the token may read that version."""


def token_allowed(verifier: Verifier, tenant: str, model: str, version: int, token: bytes) -> bool:
    """`verifier`'s answer; False, with a warning, when it raises (a verifier's bug must
    refuse the read, never serve it, and must not go unseen)."""
    try:
        return bool(verifier(tenant, model, version, token))
    except Exception as exc:
        log.warning("read-token verifier raised for %s/%s@%d: %r", tenant, model, version, exc)
        return False
