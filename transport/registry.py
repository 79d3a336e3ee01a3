"""Which transports this process can use, and which one client enables: the probes of every
backend, and the client's choice (`enabled_transports`, from `ros.connect(transports=)` or
`TENSORHUB_TRANSPORTS`).

The one module of `transport` that asks the implementations about themselves: RDMA
(`transport.rdma.availability`), same-host CUDA IPC (`transport.ipc.availability`) and NIXL
(`transport.nixl.loader`), each only when a kind is probed. The backend interface
(`transport.backend`) imports none of them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from tensorhub.errors import InvalidArgument, NoUsableTransport
from transport.kinds import TransportKind

__all__ = ["ENV", "available_transports", "enabled_transports", "unavailable_reason"]


def available_transports() -> list[TransportKind]:
    """Usable transports, best first: RDMA (only if `transport.rdma.rdma_available()`),
    same-host CUDA IPC (only with a CUDA device: `transport.ipc.ipc_available()`), then
    TCP, which is always available. A missing or broken RDMA module is not an error."""
    kinds: list[TransportKind] = []
    try:
        from transport import rdma

        if rdma.rdma_available():
            kinds.append(TransportKind.RDMA)
    except ImportError:
        pass
    from transport.ipc.availability import ipc_available

    if ipc_available():
        kinds.append(TransportKind.IPC)
    kinds.append(TransportKind.TCP)
    return kinds


ENV = "TENSORHUB_TRANSPORTS"
"""The environment variable naming a client's transports when `ros.connect` is given none:
comma-separated kinds, e.g. `nixl` or `nixl,tcp`."""


def enabled_transports(
    requested: Sequence[str] | None = None, env: Mapping[str, str] | None = None
) -> tuple[TransportKind, ...]:
    """The transports one client serves and reads over, in `transport.selection`'s order.

    None (and no `TENSORHUB_TRANSPORTS` in `env`, default `os.environ`): every transport
    of `available_transports()`, that is RDMA and CUDA IPC where this machine has them, and
    TCP. NIXL is used only when named: UCX's settings are process-wide (read from `UCX_*`
    when an agent is made, and shared with any other NIXL user in the process, such as
    vLLM's NixlConnector), and on one host UCX reads through cma, past whatever network a
    deployment meant its bytes to cross (docs/design-notes.md, "pyverbs RDMA or NIXL").
    TCP is always in: a PARTIAL holder, a TLS client and every fallback read over it.

    A named kind this process cannot use is an error, with the reason
    (`NoUsableTransport`); an unknown name is `InvalidArgument`.
    """
    if requested is None:
        named = (env if env is not None else os.environ).get(ENV, "").strip()
        if not named:
            return tuple(available_transports())
        requested = [part.strip() for part in named.split(",") if part.strip()]
    kinds = {TransportKind.TCP}
    known = {kind.value: kind for kind in TransportKind}
    for name in requested:
        kind = known.get(name) if isinstance(name, str) else None
        if kind is None:
            raise InvalidArgument(f"unknown transport {name!r}: expected some of {sorted(known)}")
        why = unavailable_reason(kind)
        if why:
            raise NoUsableTransport(f"transport {name!r} was asked for but {why}")
        kinds.add(kind)
    order = [k for k in TransportKind if k in kinds]  # the enum is in preference order
    return tuple(order)


def unavailable_reason(kind: TransportKind) -> str:
    """Why this process cannot use `kind` ('' when it can). Probing NIXL imports it."""
    if kind is TransportKind.TCP:
        return ""
    if kind is TransportKind.NIXL:
        from transport.nixl.loader import unavailable_reason as nixl_reason

        return nixl_reason() or ""
    if kind is TransportKind.RDMA:
        try:
            from transport import rdma
        except ImportError as exc:
            return f"no RDMA here ({exc})"
        return "" if rdma.rdma_available() else f"no RDMA here ({rdma.rdma_unavailable_reason()})"
    from transport.ipc.availability import ipc_unavailable_reason

    return ipc_unavailable_reason() or ""
