"""Strict validation of the names that become parts of etcd keys and wire frames.

One pattern for tenants, models and holders (DESIGN.md §2), so no name can contain `/`,
`..` or anything else that would reach into another tenant's key prefix.
"""

from __future__ import annotations

import re

from tensorhub.errors import InvalidArgument, InvalidName

NAME_PATTERN = r"[a-z0-9][a-z0-9._-]{0,62}"
_NAME_RE = re.compile(NAME_PATTERN)


def validate_name(name: object, kind: str = "name") -> str:
    """Return `name` if it matches the name pattern, else raise `InvalidName`."""
    if not isinstance(name, str) or _NAME_RE.fullmatch(name) is None or ".." in name:
        shown = repr(name) if len(repr(name)) <= 80 else repr(name)[:77] + "..."
        raise InvalidName(
            f"invalid {kind} {shown}: must match {NAME_PATTERN} "
            "(lowercase letters, digits, '.', '_', '-'; 1-63 characters; no '..')"
        )
    return name


def validate_version(version: object) -> int:
    """Return `version` if it is a positive integer, else raise `InvalidArgument`."""
    if isinstance(version, bool) or not isinstance(version, int) or version <= 0:
        raise InvalidArgument(f"invalid version {version!r}: versions are positive integers")
    if version >= 10**20:
        raise InvalidArgument(f"invalid version {version}: must be below 10**20")
    return version
