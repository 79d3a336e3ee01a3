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
from typing import TYPE_CHECKING, Any

import tensorhub as _errors
from tensorhub import *  # noqa: F403  (the one error tree, re-exported for SDK users)

if TYPE_CHECKING:
    from ros.client.handles import Held, Publication
    from ros.client.hub import Hub
    from ros.client.slice import Slice
    from ros.client.slice_fetch import SliceFetch

_LAZY = {
    "Hub": "ros.client.hub",
    "Held": "ros.client.handles",
    "Publication": "ros.client.handles",
    "Slice": "ros.client.slice",
    "SliceFetch": "ros.client.slice_fetch",
}


def __getattr__(name: str) -> Any:
    """Import the SDK (and torch) only when it is used, so `tensorhub ls` starts fast."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ros' has no attribute {name!r}")


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
    from ros.client.hub import Hub

    return Hub(endpoints, tenant=tenant, token=token, topology=topology, listen=listen, **options)  # type: ignore[arg-type]


__all__ = [*_errors.__all__, "Held", "Hub", "Publication", "Slice", "SliceFetch", "connect"]  # noqa: PLE0604
