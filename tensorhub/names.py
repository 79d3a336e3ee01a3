"""Strict validation of the names that become parts of etcd keys and wire frames.

One pattern for tenants, models and holders (docs/design.md, "Keys in etcd"), so no name can
contain `/`,
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


MAX_VERSION = 2**53 - 1
"""The largest version number (9,007,199,254,740,991: exact in a JSON number, and room for
microsecond timestamps). A publish must name a version above `latest`, so a model at the
bound cannot move on: the bound keeps that far from anything a client meets by accident
(2**63 - 1 was accepted and left its model stuck), and `tensorhub delete MODEL` frees a
model that got there."""


def validate_version(version: object) -> int:
    """Return `version` if it is an integer in 1..`MAX_VERSION`, else raise `InvalidArgument`."""
    if isinstance(version, bool) or not isinstance(version, int) or version <= 0:
        raise InvalidArgument(f"invalid version {version!r}: versions are positive integers")
    if version > MAX_VERSION:
        raise InvalidArgument(
            f"invalid version {version}: versions are at most MAX_VERSION = 2**53 - 1 "
            f"({MAX_VERSION})"
        )
    return version
