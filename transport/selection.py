"""Which transport a reader uses for one holder, and why it did not use a better one.

A holder record advertises one endpoint per transport it serves (`tensorhub.endpoints`).
A reader tries them in preference order, RDMA → same-host CUDA IPC (a later issue: the
slot is `PREFERENCE`'s second place, not yet a kind) → TCP, and takes the first that
both sides can use. Each kind it passes over leaves its reason in `Route.fallback`, so a
fetch that runs over TCP although the holder offered RDMA says so (log and
`FetchStats.fallbacks`); a holder with no kind this reader can use raises
`NoUsableTransport` with every reason, and the SDK skips it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tensorhub.endpoints import parse_endpoint
from tensorhub.errors import InvalidArgument, NoUsableTransport
from transport.backend import TransportKind, available_transports

# Best first. Same-host CUDA IPC goes between RDMA and TCP when the GPU issue adds it.
PREFERENCE: tuple[TransportKind, ...] = (TransportKind.RDMA, TransportKind.TCP)


@dataclass(frozen=True)
class Route:
    """How to read one holder: over `kind`, at `host:port` (for RDMA: its TCP control
    channel); `fallback` says why a better kind the holder offered was not used ('' when
    the best one was)."""

    kind: TransportKind
    host: str
    port: int
    fallback: str = ""


def local_reason(kind: TransportKind, local: Sequence[TransportKind]) -> str:
    """Why this process cannot read over `kind` ('' when it can)."""
    if kind in local:
        return ""
    if kind is TransportKind.RDMA:
        from transport.rdma import rdma_unavailable_reason

        return f"no RDMA here ({rdma_unavailable_reason() or 'not offered by this process'})"
    return f"{kind.value} is not available here"


def choose(
    endpoints: Mapping[str, str],
    *,
    complete: bool,
    tls: bool = False,
    local: Sequence[TransportKind] | None = None,
    device_memory: bool = False,
) -> Route:
    """The best transport for a holder advertising `endpoints`, as seen by this reader.

    `complete`: the holder has every chunk (RDMA reads are one-sided and cannot wait for a
    chunk a PARTIAL holder is still receiving, so a PARTIAL holder is read over TCP).
    `tls`: this reader requires TLS (RDMA reads are not encrypted, so TLS means TCP).
    `local`: the kinds this process can use (default `available_transports()`).
    `device_memory`: the destination is GPU memory, which the RDMA channel cannot register
    (it reads into host memory only), so such a fetch reads the holder over TCP (staged)
    instead of dropping it.
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
        why = local_reason(kind, have)
        if not why and kind is TransportKind.RDMA and tls:
            why = "TLS is required and RDMA reads are not encrypted"
        if not why and kind is TransportKind.RDMA and device_memory:
            why = "the destination is device memory (the RDMA channel reads into host memory)"
        if not why and kind is TransportKind.RDMA and not complete:
            why = "the holder is PARTIAL (one-sided reads cannot wait for its chunks)"
        if why:
            reasons.append(f"{kind.value}: {why}")
            continue
        try:
            host, port = parse_endpoint(address)
        except InvalidArgument as exc:
            reasons.append(f"{kind.value}: {exc}")
            bad.append(exc)
            continue
        return Route(kind, host, port, "; ".join(reasons))
    if len(reasons) == 1 and bad:  # one endpoint, malformed: its own message says it all
        raise bad[0]
    shown = sorted(endpoints)
    raise NoUsableTransport(
        f"no transport this reader can use (has: {shown}): {'; '.join(reasons)}"
    )
