"""How `consistency.etcd.Etcd` turns a gRPC error from etcd into a `TensorHubError`.

etcd's own refusals are named by `consistency.refusals`; the rest here: auth (no credentials,
a refused token, a missing permission), deadlines, no member answering, unknown leases,
compacted revisions, and NOSPACE.
"""

from __future__ import annotations

import grpc

from consistency.etcd_auth import token_refused
from consistency.refusals import name_refusal
from consistency.retry import is_deadline
from tensorhub.errors import (
    DeadlineExceeded,
    EtcdAuthFailed,
    LeaseNotFound,
    RevisionCompacted,
    StorageFull,
    TensorHubError,
    Unavailable,
)

__all__ = ["translate"]


def translate(exc: grpc.RpcError, budget: float) -> TensorHubError:
    """The `TensorHubError` that a call's last gRPC error means (`budget`: its deadline)."""
    code = exc.code()
    details = exc.details() or ""
    refused = name_refusal(code, details)  # each of etcd's refusals, named (consistency.refusals)
    if refused is not None:
        return refused
    if "user name is empty" in details:
        return EtcdAuthFailed(
            f"etcd has auth enabled and the hub has no etcd credentials ({details}): set "
            "--etcd-user and --etcd-password-file"
        )
    # A Defragment without root comes back as UNKNOWN "auth: permission denied".
    denied = code == grpc.StatusCode.PERMISSION_DENIED or "permission denied" in details
    if token_refused(exc) or denied:
        return EtcdAuthFailed(
            f"etcd refused the hub's credentials ({details}): the etcd user needs read and "
            "write on the hub's key prefix, and the root role to defragment"
        )
    if is_deadline(exc):
        return DeadlineExceeded(f"etcd did not answer within {budget:.1f}s ({details})")
    if code == grpc.StatusCode.UNAVAILABLE:
        return Unavailable(f"no etcd member answered within {budget:.1f}s: {details}")
    if code == grpc.StatusCode.NOT_FOUND and "lease" in details:
        return LeaseNotFound(details)
    if code == grpc.StatusCode.OUT_OF_RANGE and "compacted" in details:
        return RevisionCompacted(details, 0)
    if "database space exceeded" in details:
        # NOSPACE: RESOURCE_EXHAUSTED from the quota check and the capped applier; matched on
        # the words too, since some paths hand it back as UNKNOWN.
        return StorageFull(f"etcd is out of space (NOSPACE alarm): {details}")
    return TensorHubError(f"etcd error {code.name}: {details}")
