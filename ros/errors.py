"""TensorHub errors over gRPC, both ways, from the one registry in `tensorhub.errors`.

The hub answers a `TensorHubError` with its class's status code, the class name in trailing
metadata (`tensorhub-error`) and, for a class with `fields`, their values as a JSON object
(`tensorhub-error-fields`); the SDK rebuilds the same class, so a caller catches
`StaleVersion` rather than parsing status details. A name the registry does not know falls
back by status code (`tensorhub.errors.default_for`).

UNKNOWN is the one code whose meaning depends on the call: after a write its reply may have
been lost (`OutcomeUnknown`, read back to find out); a read changed nothing, so there it is
an `InternalError`. The caller names the method it called; without one, the conservative
write reading is taken.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

import grpc

import tensorhub.errors as errors_module
from tensorhub.errors import InternalError, OutcomeUnknown, TensorHubError

log = logging.getLogger(__name__)

ERROR_METADATA_KEY = "tensorhub-error"
FIELDS_METADATA_KEY = "tensorhub-error-fields"

# Methods that change nothing in etcd: an UNKNOWN answer to one of them is no lost write.
# Every other method of the service is a write (a test checks the proto has no third kind).
READ_METHODS = frozenset(
    {
        "Latest", "Resolve", "Inspect", "ListModels", "Watch", "ResolveLayout",
        "ResolveLayoutCover", "DeclaredLayouts",
    }
)  # fmt: skip

_CODES: dict[str, grpc.StatusCode] = {code.name: code for code in grpc.StatusCode}
_CLASSES = errors_module.registered()  # by name: every class of tensorhub.errors

for _cls in _CLASSES.values():  # a typo in a `@_code(...)` fails at import, not on the wire
    if _cls.code not in _CODES:
        raise TypeError(f"{_cls.__name__}.code {_cls.code!r} is not a gRPC status code")


def status_of(exc: TensorHubError) -> grpc.StatusCode:
    """The gRPC status code a hub answers with for `exc`."""
    return _CODES.get(exc.code, grpc.StatusCode.UNKNOWN)


def wire_name(exc: TensorHubError) -> str:
    """The name a hub sends for `exc`: its class's, or its nearest registered ancestor's
    (a subclass defined elsewhere must not reach the client as a name it cannot rebuild)."""
    for cls in type(exc).__mro__:
        if _CLASSES.get(cls.__name__) is cls:
            return cls.__name__
    return TensorHubError.__name__


def error_metadata(exc: TensorHubError) -> tuple[tuple[str, str], ...]:
    """The trailing metadata a hub answers `exc` with: its name, and its fields if any."""
    metadata = [(ERROR_METADATA_KEY, wire_name(exc))]
    fields = {name: getattr(exc, name) for name in type(exc).fields if hasattr(exc, name)}
    if fields:
        metadata.append((FIELDS_METADATA_KEY, json.dumps(fields, separators=(",", ":"))))
    return tuple(metadata)


def _text(value: str | bytes) -> str:
    return value if isinstance(value, str) else bytes(value).decode(errors="replace")


def _fields(raw: str) -> Mapping[str, Any]:
    try:
        fields = json.loads(raw)
    except ValueError:
        return {}
    return fields if isinstance(fields, dict) else {}


def _rebuild(cls: type[TensorHubError], details: str, fields: Mapping[str, Any]) -> TensorHubError:
    """`cls(details)` with the fields the class declares set from `fields`, each only if its
    value has the type of the class's default (a hostile hub cannot plant anything else)."""
    error = cls(details)
    for name in cls.fields:
        value, default = fields.get(name), getattr(cls, name, None)
        if default is None or value is None or isinstance(value, bool):
            continue
        if isinstance(default, float) and isinstance(value, int):
            value = float(value)
        if type(value) is type(default):
            setattr(error, name, value)
    return error


def from_rpc_error(exc: grpc.RpcError, method: str | None = None) -> TensorHubError:
    """The TensorHubError a failed call of `method` stands for (its class restored from
    metadata). UNKNOWN without a class name is an `OutcomeUnknown` after a write (or when
    `method` is not given) and an `InternalError` after a read (`READ_METHODS`)."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = (exc.details() if hasattr(exc, "details") else None) or str(exc)
    name, raw_fields = "", ""
    trailing: Any = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
    for item in trailing or ():
        key, value = item[0], item[1]
        if key == ERROR_METADATA_KEY:
            name = _text(value)
        elif key == FIELDS_METADATA_KEY:
            raw_fields = _text(value)
    cls = _CLASSES.get(name) or errors_module.default_for(code.name) or TensorHubError
    if cls is OutcomeUnknown and method in READ_METHODS:
        # A read changed nothing: no outcome is unknown, the hub (or a proxy) failed.
        return InternalError(f"{method} was answered {code.name}: {details}")
    return _rebuild(cls, details, _fields(raw_fields) if raw_fields else {})


def from_outcome(name: str, message: str, fields: str) -> TensorHubError:
    """The TensorHubError one item of an answer names (a `ShardOutcome` of PublishShards:
    its class name, message and fields, as `error_metadata` writes them for a call),
    rebuilt as `from_rpc_error` rebuilds a call's."""
    cls = _CLASSES.get(name) or TensorHubError
    return _rebuild(cls, message, _fields(fields) if fields else {})
