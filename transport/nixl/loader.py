"""Importing NIXL so that the process it runs in exits cleanly (docs/nixl.md, "The exit crash").

The `nixl-cu12` wheel bundles its own rdma-core (`libibverbs`, `libmlx5`) and libnl
(`libnl-3`, `libnl-route-3`) under hashed names, and UCX loads its transport modules with
`RTLD_GLOBAL`, which puts those copies in the process's global symbol scope. One module,
`libuct_ib_efa`, needs `libefa.so.1`, which the wheel does not bundle. On a host with
Debian's `ibverbs-providers` (which `python3-pyverbs` pulls in) the host's `libefa` is found,
and with it the host's `libibverbs.so.1`, `libnl-route-3.so.200` and `libnl-3.so.200`. Their
symbols then bind to the wheel's copies, already global: the host libnl-route's constructors
register their traffic-control ops in the wheel's lists, where ops of the same names already
are, so registration fails and leaves those ops unlinked; at exit, its destructors unlink them
(`rtnl_tc_unregister`) through null pointers, and every NIXL process dies with SIGSEGV.

`load` opens the host's `libefa.so.1` (with its `libibverbs` and libnl) before NIXL: with
`RTLD_NOW | RTLD_LOCAL`, while no copy of the wheel is loaded, so every symbol of the host's
chain binds inside that chain, at once. UCX then finds `libefa.so.1` already loaded and loads
nothing more. Each copy keeps to itself and the process exits 0, with InfiniBand and every
other UCX module left enabled. On a host without `libefa.so.1`, there is nothing to open and
nothing to fix (UCX skips the EFA module, as it does there without this loader).
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import importlib.util
from types import ModuleType

HOST_LIBRARIES = ("libefa.so.1",)
"""Host libraries the wheel's UCX modules need but the wheel does not bundle: opened first."""

MODULES = ("nixl", "nixl_cu12", "nixl_cu13")
"""The import names of NIXL's Python API, tried in order. `nixl` first: the meta-package that
vLLM's NixlConnector imports (`nixl._api`) picks the CUDA variant (`nixl_cu12` or `nixl_cu13`)
and re-exports it, so where it is installed TensorHub uses the same build and one UCX. Two
builds in one process would each load their own UCX. Without it (`tensorhub[nixl]` installs
`nixl-cu12` alone), the variant is imported directly."""


def pin_host_libraries() -> list[str]:
    """Open each of `HOST_LIBRARIES` this host has, bound within its own chain; the names
    opened. Harmless to call again (the loader counts references)."""
    opened = []
    for name in HOST_LIBRARIES:
        try:
            ctypes.CDLL(name, mode=ctypes.RTLD_LOCAL)
        except OSError:
            continue
        opened.append(name)
    return opened


@functools.cache
def load() -> ModuleType:
    """NIXL's Python API module, imported after `pin_host_libraries`. `ImportError` (with
    each name's reason) when no NIXL wheel is installed."""
    pin_host_libraries()
    reasons = []
    for name in MODULES:
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            reasons.append(f"{name}: {exc}")
    raise ImportError(f"NIXL cannot be imported ({'; '.join(reasons)})")


def unavailable_reason() -> str | None:
    """Why NIXL cannot be used in this process, or None when it can. Without a NIXL wheel
    installed this loads nothing (not even the host libraries)."""
    if not any(importlib.util.find_spec(name) for name in MODULES):
        return "NIXL is not installed (pip install 'tensorhub[nixl]')"
    try:
        load()
    except ImportError as exc:
        return str(exc)
    return None
