"""etcd's refusals, each named: what etcd said, as the `TensorHubError` it means, with the
outcome stated.

A refusal left as a bare `TensorHubError("etcd error ...")` would reach the caller as
UNKNOWN, the status that means "the outcome is unknown", although etcd refused the request
before applying anything. etcd words its refusals in fixed strings
(`etcdserver/api/v3rpc/rpctypes`); gRPC itself refuses a message over the server's limit
(etcd sets it to its `--max-request-bytes` plus a margin) before etcd sees it.

Definite (nothing was applied): request too large, too many operations in one transaction,
a key given twice in one transaction (`InvalidArgument`); NOSPACE (`StorageFull`); too many
requests, no leader, server stopped, unhealthy cluster, corrupt cluster (`Unavailable`).
Unknown (a proposal may have been committed): request timed out, leader changed:
`WriteUnconfirmed`, an `Unavailable` that `Etcd.txn` turns into `OutcomeUnknown` when the
transaction writes (a read that timed out changed nothing).
"""

from __future__ import annotations

from collections.abc import Callable

import grpc

from tensorhub.errors import (
    InvalidArgument,
    StorageFull,
    TensorHubError,
    Unavailable,
    WriteUnconfirmed,
)

__all__ = ["name_refusal"]


def _nothing(what: str) -> Callable[[str], str]:
    return lambda details: f"{what} ({details}): nothing was written"


_TOO_LARGE = _nothing("etcd refused the request as larger than its request limit")
_REFUSALS: tuple[tuple[str, Callable[[str], TensorHubError]], ...] = (
    ("request is too large", lambda d: InvalidArgument(_TOO_LARGE(d))),
    ("too many operations in txn request", lambda d: InvalidArgument(
        _nothing("etcd refused a transaction of more operations than its --max-txn-ops")(d))),
    ("duplicate key given in txn request", lambda d: InvalidArgument(
        _nothing("etcd refused a transaction that names one key twice")(d))),
    ("database space exceeded", lambda d: StorageFull(
        _nothing("etcd is out of space (NOSPACE alarm)")(d))),
    ("too many requests", lambda d: Unavailable(
        _nothing("etcd is overloaded (too many requests); retry with backoff")(d))),
    ("no leader", lambda d: Unavailable(_nothing("etcd has no leader")(d))),
    ("server stopped", lambda d: Unavailable(_nothing("the etcd member is stopping")(d))),
    ("unhealthy cluster", lambda d: Unavailable(_nothing("the etcd cluster is unhealthy")(d))),
    ("corrupt cluster", lambda d: Unavailable(_nothing("etcd reports a corrupt cluster")(d))),
    ("request timed out", lambda d: WriteUnconfirmed(
        f"etcd did not confirm the request in time ({d}): a write may or may not have been "
        "applied")),
    ("leader changed", lambda d: WriteUnconfirmed(
        f"etcd's leader changed during the request ({d}): a write may or may not have been "
        "applied")),
)  # fmt: skip


def name_refusal(code: grpc.StatusCode, details: str) -> TensorHubError | None:
    """The named error for one of etcd's (or gRPC's) refusals, or None if `details` is
    none of them (the caller maps deadlines, unreachable members and the rest)."""
    for words, make in _REFUSALS:
        if words in details:
            return make(details)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in details.lower():
        return InvalidArgument(_TOO_LARGE(details))  # gRPC's own limit, before etcd's
    return None
