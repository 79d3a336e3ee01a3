"""TensorHub's user-facing model: Reference-Oriented Storage of weight versions.

```python
import ros
hub = ros.connect("127.0.0.1:7600", tenant="team-a", token="...")
pub = hub.publish("policy", 3, model.state_dict())
pub.wait_replicated(1, timeout=60)
held = hub.fetch("policy", "latest", into=model.state_dict())
```
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ros.client.handles import Held, Publication
from ros.client.hub import Hub
from tensorhub.errors import (
    AlreadyExists,
    DeadlineExceeded,
    IntegrityError,
    InvalidArgument,
    InvalidName,
    LeaseLost,
    OutcomeUnknown,
    PermissionDenied,
    QuotaExceeded,
    RetentionViolation,
    StaleVersion,
    TensorHubError,
    TransportError,
    Unavailable,
    VersionNotFound,
    VersionUnavailable,
)


def connect(
    endpoints: str | Sequence[str],
    *,
    tenant: str,
    token: str,
    topology: Mapping[str, str] | None = None,
    listen: str = "127.0.0.1:0",
    **options: object,
) -> Hub:
    """Connect to the hub (one address or several replicas) as `tenant`; see `Hub`."""
    return Hub(endpoints, tenant=tenant, token=token, topology=topology, listen=listen, **options)  # type: ignore[arg-type]


__all__ = [
    "AlreadyExists",
    "DeadlineExceeded",
    "Held",
    "Hub",
    "IntegrityError",
    "InvalidArgument",
    "InvalidName",
    "LeaseLost",
    "OutcomeUnknown",
    "PermissionDenied",
    "Publication",
    "QuotaExceeded",
    "RetentionViolation",
    "StaleVersion",
    "TensorHubError",
    "TransportError",
    "Unavailable",
    "VersionNotFound",
    "VersionUnavailable",
    "connect",
]
