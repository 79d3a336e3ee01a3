"""The read-token check and the held-version lookup every holder backend runs before it
serves or shares any memory.

A `Verifier` says whether `token` may read tenant/model@version. The TCP data port, the
RDMA control channel and the same-host IPC channel all ask it through `lookup` (which asks
`token_allowed`), so a verifier that raises is refused, and logged, the same way on each,
and a request is checked in the same order on each: the token, then held here, not
released, the same layout, chunks in range.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from transport.store import HeldVersion, HolderStore, Key
from transport.wire import ErrorCode

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


@dataclass(frozen=True)
class Refused:
    """Why a request is refused, as the reader is told (`code`, `message`). `token_ok`:
    the token itself passed (its connection counts as authenticated all the same, so a
    full holder evicts it last)."""

    code: ErrorCode
    message: str
    token_ok: bool


def lookup(
    store: HolderStore,
    verifier: Verifier,
    key: Key,
    token: bytes,
    layout_digest: int,
    chunks: Sequence[int] = (),
) -> HeldVersion | Refused:
    """The held version a request names, or why it is refused: the token first (a verifier
    that raises refuses), then held here, not released, the same layout, every chunk of
    `chunks` inside it."""
    tenant, model, version = key
    if not token_allowed(verifier, tenant, model, version, token):
        return Refused(ErrorCode.DENIED, "read token refused", token_ok=False)
    held = store.get(key)
    if held is None:
        return Refused(ErrorCode.NOT_HELD, f"{model}@{version} is not held here", True)
    if held.released:
        return Refused(ErrorCode.RELEASED, f"{model}@{version} is released", True)
    if held.layout.digest != layout_digest:
        return Refused(ErrorCode.LAYOUT_MISMATCH, "layout digest differs", True)
    if any(not 0 <= i < held.layout.num_chunks for i in chunks):
        return Refused(ErrorCode.BAD_REQUEST, "chunk index out of range", True)
    return held
