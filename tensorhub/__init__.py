"""Shared leaf of TensorHub: the one exception tree and the name rules.

`consistency` and `transport` must not import each other, yet their errors belong to one
tree rooted at `TensorHubError` (docs/design.md, "Errors and outcomes"); this package is the
leaf both depend on.
"""

from tensorhub.errors import (
    AlreadyExists,
    DeadlineExceeded,
    IntegrityError,
    InternalError,
    InvalidArgument,
    InvalidManifest,
    InvalidName,
    LeaseLost,
    OutcomeUnknown,
    OutOfMemory,
    PermissionDenied,
    QuotaExceeded,
    RetentionViolation,
    SessionExpired,
    SpillBudgetExceeded,
    StaleVersion,
    TensorHubError,
    TooManyDeclaredLayouts,
    TransportError,
    Unavailable,
    VersionNotFound,
    VersionRetired,
    VersionUnavailable,
)

__all__ = [
    "AlreadyExists",
    "DeadlineExceeded",
    "IntegrityError",
    "InternalError",
    "InvalidArgument",
    "InvalidManifest",
    "InvalidName",
    "LeaseLost",
    "OutOfMemory",
    "OutcomeUnknown",
    "PermissionDenied",
    "QuotaExceeded",
    "RetentionViolation",
    "SessionExpired",
    "SpillBudgetExceeded",
    "StaleVersion",
    "TensorHubError",
    "TooManyDeclaredLayouts",
    "TransportError",
    "Unavailable",
    "VersionNotFound",
    "VersionRetired",
    "VersionUnavailable",
]
