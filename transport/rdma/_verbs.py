"""Lazy access to pyverbs, so that TensorHub imports and runs (over TCP) where it is missing.

pyverbs comes from the distribution (Debian's ``python3-pyverbs``), not from PyPI, so most
machines lack it. Nothing in this package imports it at module level; code that needs it calls
`load()`, which raises a `TransportError` with the reason instead of an `ImportError`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from tensorhub.errors import TransportError


@dataclass(frozen=True)
class Verbs:
    """The pyverbs modules this package uses, imported once.

    Attributes are typed `Any`: pyverbs is a Cython extension without type stubs.
    """

    device: Any
    pd: Any
    mr: Any
    cq: Any
    qp: Any
    wr: Any
    addr: Any
    enums: Any
    error: type[Exception]


@functools.cache
def _load() -> Verbs | str:
    try:
        from pyverbs import addr, cq, device, enums, mr, pd, qp, wr
        from pyverbs.pyverbs_error import PyverbsError
    except ImportError as ex:
        return f"pyverbs not installed ({ex})"
    except Exception as ex:  # a broken install (e.g. missing libibverbs) raises OSError & co.
        return f"pyverbs failed to import: {type(ex).__name__}: {ex}"
    return Verbs(device, pd, mr, cq, qp, wr, addr, enums, PyverbsError)


def import_error() -> str:
    """Why pyverbs cannot be imported, or '' when it can."""
    loaded = _load()
    return loaded if isinstance(loaded, str) else ""


def load() -> Verbs:
    """Return the pyverbs modules, or raise `TransportError` saying why they are missing."""
    loaded = _load()
    if isinstance(loaded, str):
        raise TransportError(f"RDMA unavailable: {loaded}")
    return loaded


def verbs_error(what: str, ex: BaseException) -> TransportError:
    """Wrap a pyverbs failure in the named transport error, keeping pyverbs' message."""
    return TransportError(f"RDMA {what} failed: {ex}")
