"""One table between TensorHub errors and gRPC status codes, used both ways.

The hub turns a `TensorHubError` into a status code plus the error's class name in trailing
metadata (`tensorhub-error`); the SDK turns it back into the same class, so a caller catches
`StaleVersion` rather than parsing status details. Unknown names fall back by status code.
"""

from __future__ import annotations

from typing import Any

import grpc

import tensorhub.errors as errors_module
from consistency.etcd import LeaseNotFound, RevisionCompacted
from consistency.floor import StaleRead
from tensorhub.errors import TensorHubError

ERROR_METADATA_KEY = "tensorhub-error"

_CODES: dict[str, grpc.StatusCode] = {code.name: code for code in grpc.StatusCode}

# Fallback from a status code to a class when the metadata names no known class.
_BY_CODE: dict[grpc.StatusCode, type[TensorHubError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: errors_module.InvalidArgument,
    grpc.StatusCode.NOT_FOUND: errors_module.VersionNotFound,
    grpc.StatusCode.ALREADY_EXISTS: errors_module.AlreadyExists,
    grpc.StatusCode.PERMISSION_DENIED: errors_module.PermissionDenied,
    grpc.StatusCode.UNAUTHENTICATED: errors_module.PermissionDenied,
    # Without a class name it is not the hub's quota refusal (that always names its class)
    # but gRPC's own: its concurrent-call limit, or a message too large. Overloaded, so the
    # SDK backs off and retries instead of reporting a quota it did not reach.
    grpc.StatusCode.RESOURCE_EXHAUSTED: errors_module.Overloaded,
    grpc.StatusCode.DEADLINE_EXCEEDED: errors_module.DeadlineExceeded,
    grpc.StatusCode.UNAVAILABLE: errors_module.Unavailable,
    grpc.StatusCode.FAILED_PRECONDITION: errors_module.StaleVersion,
    grpc.StatusCode.DATA_LOSS: errors_module.IntegrityError,
    grpc.StatusCode.UNKNOWN: errors_module.OutcomeUnknown,
}


def _known_classes() -> dict[str, type[TensorHubError]]:
    found: dict[str, type[TensorHubError]] = {}
    for module_obj in (errors_module,):
        for name in dir(module_obj):
            obj = getattr(module_obj, name)
            if isinstance(obj, type) and issubclass(obj, TensorHubError):
                found[name] = obj
    for cls in (StaleRead, LeaseNotFound, RevisionCompacted):
        found[cls.__name__] = cls
    return found


_CLASSES = _known_classes()


def status_of(exc: TensorHubError) -> grpc.StatusCode:
    """The gRPC status code a hub answers with for `exc`."""
    return _CODES.get(exc.code, grpc.StatusCode.UNKNOWN)


def from_rpc_error(exc: grpc.RpcError) -> TensorHubError:
    """The TensorHubError a failed call stands for (its class restored from metadata)."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = (exc.details() if hasattr(exc, "details") else None) or str(exc)
    name = ""
    trailing: Any = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
    for item in trailing or ():
        key, value = item[0], item[1]
        if key == ERROR_METADATA_KEY:
            name = value if isinstance(value, str) else bytes(value).decode()
    cls = _CLASSES.get(name) or _BY_CODE.get(code, TensorHubError)
    if cls is RevisionCompacted:
        return RevisionCompacted(details, 0)
    return cls(details)
