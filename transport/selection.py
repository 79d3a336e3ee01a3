"""Which transport a reader uses for one holder, and why it did not use a better one.

A holder record advertises one endpoint per transport it serves (`tensorhub.endpoints`).
A reader tries them in preference order, NIXL → RDMA → same-host CUDA IPC → TCP, and takes
the first that both sides can use (NIXL only where the client enabled it:
`transport.registry.enabled_transports`). RDMA reads into host memory and IPC copies into
GPU memory, so for one destination at most one of them is in the running. Each kind it passes over
leaves its reason in `Route.fallback`, so a fetch that runs over TCP although the holder
offered RDMA says so (log and `FetchStats.fallbacks`); a holder with no kind this reader
can use raises `NoUsableTransport` with every reason, and the SDK skips it.

IPC is chosen here only on what can be known before connecting (this process has CUDA,
the destination is GPU memory, the holder is COMPLETE, no TLS, no recent failure with this
holder: the reader's `transport.ipc.fingerprint.Verdicts`). Whether the two processes
can really share memory is proven when the channel opens (`transport.ipc.channel`): it
falls back to the holder's TCP endpoint (`Route.tcp`), with the reason, when they cannot.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tensorhub.endpoints import parse_endpoint
from tensorhub.errors import InvalidArgument, NoUsableTransport
from transport.kinds import TransportKind
from transport.registry import available_transports

if TYPE_CHECKING:
    from transport.ipc.fingerprint import Verdicts

# Best first.
PREFERENCE: tuple[TransportKind, ...] = tuple(TransportKind)  # NIXL, RDMA, IPC, TCP


@dataclass(frozen=True)
class Route:
    """How to read one holder: over `kind`, at `host:port` (for RDMA and IPC: its TCP
    control channel); `fallback` says why a better kind the holder offered was not used
    ('' when the best one was); `tcp` is the holder's TCP endpoint when `kind` may still
    fall back to it on opening (IPC), else None."""

    kind: TransportKind
    host: str
    port: int
    fallback: str = ""
    tcp: tuple[str, int] | None = None


def local_reason(kind: TransportKind, local: Sequence[TransportKind]) -> str:
    """Why this process cannot read over `kind` ('' when it can)."""
    if kind in local:
        return ""
    if kind is TransportKind.NIXL:
        return 'not enabled by this client (ros.connect(transports=["nixl"]))'
    if kind is TransportKind.RDMA:
        from transport.rdma import rdma_unavailable_reason

        return f"no RDMA here ({rdma_unavailable_reason() or 'not offered by this process'})"
    if kind is TransportKind.IPC:
        from transport.ipc.availability import ipc_unavailable_reason

        return ipc_unavailable_reason() or "not offered by this process"
    return f"{kind.value} is not available here"


def _refusal(
    kind: TransportKind,
    address: str,
    *,
    complete: bool,
    tls: bool,
    device_memory: bool,
    verdicts: Verdicts | None,
) -> str:
    """Why this reader passes over `kind` for a holder that advertises it ('' if it does
    not), on what the reader knows before connecting."""
    if kind is TransportKind.RDMA:
        if tls:
            return "TLS is required and RDMA reads are not encrypted"
        if device_memory:
            return "the destination is device memory (the RDMA channel reads into host memory)"
        if not complete:
            return "the holder is PARTIAL (one-sided reads cannot wait for its chunks)"
    if kind is TransportKind.NIXL:
        if tls:
            return "TLS is required and NIXL reads are not encrypted"
        if device_memory:
            return "the destination is device memory (this NIXL backend reads host memory)"
        if not complete:
            return "the holder is PARTIAL (it offers NIXL only for a COMPLETE version)"
    if kind is TransportKind.IPC:
        if not device_memory:
            return "the destination is host memory (CUDA IPC copies GPU memory to GPU memory)"
        if tls:
            return "TLS is required and the IPC control channel is not encrypted"
        if not complete:
            return "the holder is PARTIAL (a lease maps the whole version at once)"
        if verdicts is not None and (known := verdicts.known(address)):
            return f"failed with this holder lately: {known}"
    return ""


def _tcp(endpoints: Mapping[str, str]) -> tuple[str, int] | None:
    address = endpoints.get(TransportKind.TCP.value)
    if address is None:
        return None
    try:
        return parse_endpoint(address)
    except InvalidArgument:
        return None


def choose(
    endpoints: Mapping[str, str],
    *,
    complete: bool,
    tls: bool = False,
    local: Sequence[TransportKind] | None = None,
    device_memory: bool = False,
    verdicts: Verdicts | None = None,
) -> Route:
    """The best transport for a holder advertising `endpoints`, as seen by this reader.

    `complete`: the holder has every chunk (RDMA reads are one-sided and cannot wait for a
    chunk a PARTIAL holder is still receiving, so a PARTIAL holder is read over TCP).
    `tls`: this reader requires TLS (RDMA reads are not encrypted, so TLS means TCP).
    `local`: the kinds this process can use (default `available_transports()`).
    `device_memory`: the destination is GPU memory, which the RDMA channel cannot register
    (it reads into host memory only), so such a fetch reads the holder over same-host CUDA
    IPC or TCP (staged) instead of dropping it; IPC needs it.
    `verdicts`: the reader's holders whose IPC failed lately (its `ReaderBackends`').
    Raises `NoUsableTransport` naming every reason when none fits.
    """
    have = available_transports() if local is None else list(local)
    reasons: list[str] = []
    bad: list[InvalidArgument] = []
    for kind in PREFERENCE:
        address = endpoints.get(kind.value)
        if address is None:
            if kind is TransportKind.TCP or reasons:
                reasons.append(f"{kind.value}: not advertised")
            continue
        why = local_reason(kind, have) or _refusal(
            kind, address, complete=complete, tls=tls, device_memory=device_memory,
            verdicts=verdicts,
        )  # fmt: skip
        if why:
            reasons.append(f"{kind.value}: {why}")
            continue
        try:
            host, port = parse_endpoint(address)
        except InvalidArgument as exc:
            reasons.append(f"{kind.value}: {exc}")
            bad.append(exc)
            continue
        fallback = _tcp(endpoints) if kind is TransportKind.IPC else None
        return Route(kind, host, port, "; ".join(reasons), fallback)
    if len(reasons) == 1 and bad:  # one endpoint, malformed: its own message says it all
        raise bad[0]
    shown = sorted(endpoints)
    raise NoUsableTransport(
        f"no transport this reader can use (has: {shown}): {'; '.join(reasons)}"
    )
