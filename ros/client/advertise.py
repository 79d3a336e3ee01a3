"""Which holder backends a client serves beside TCP, and what its holder record advertises.

TCP always (the holder server, `ros.client.serving`). RDMA too when `rdma_available()`
says this machine has a usable device: an `RdmaControlServer` over the same store and
verifier as the TCP server, its `HOST:PORT` (same host as the tcp endpoint) advertised as
the `rdma` endpoint. Queue-pair numbers, GIDs and keys are exchanged on that channel per
reader, never written into the record (tensorhub/endpoints.py). Same-host CUDA IPC
likewise when this process has a CUDA device (`ipc_unavailable_reason()` is empty): an
`IpcControlServer`, advertised as `ipc`; it grants leases only on versions held in GPU
memory. NIXL when the client enabled it (`transports=`, `transport.registry.enabled_transports`):
a `NixlHolder`, advertised as `nixl`; it offers COMPLETE host-memory versions. A client with
TLS serves none of them: their control channels (and one-sided reads)
are not encrypted, and a holder that requires TLS must not serve bytes without it. Readers
pick among what is advertised (`transport.selection`). Each backend built here belongs to
the client that asked for it (`Serving` stops it at close).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from tensorhub.endpoints import format_endpoint, parse_endpoint
from transport.backend import HolderBackend, TransportKind
from transport.ipc import ipc_unavailable_reason
from transport.ipc.server import IpcControlServer
from transport.rdma import rdma_available, rdma_unavailable_reason
from transport.rdma.control import RdmaControlServer
from transport.store import HolderStore
from transport.verifier import Verifier

log = logging.getLogger(__name__)


def control_backends(
    store: HolderStore,
    verifier: Verifier,
    listen_host: str,
    *,
    tls: bool,
    kinds: Sequence[TransportKind] = (TransportKind.RDMA, TransportKind.IPC),
) -> list[HolderBackend]:
    """Every control-channel backend among `kinds` (NIXL, RDMA, IPC) this machine can serve
    over `store`, started; the ones it cannot, logged with why."""
    no_rdma = "" if rdma_available() else rdma_unavailable_reason() or "no device"
    off = "not enabled by this client"
    started = [
        _start(
            "nixl", "" if TransportKind.NIXL in kinds else off, tls,
            lambda: _nixl_holder(store, verifier, listen_host),
        ),
        _start(
            "rdma", no_rdma if TransportKind.RDMA in kinds else off, tls,
            lambda: RdmaControlServer(store, verifier, listen_host, 0).start(),
        ),
        _start(
            "ipc", ipc_unavailable_reason() if TransportKind.IPC in kinds else off, tls,
            lambda: IpcControlServer(store, verifier, listen_host, 0).start(),
        ),
    ]  # fmt: skip
    return [b for b in started if b is not None]


def _nixl_holder(store: HolderStore, verifier: Verifier, host: str) -> HolderBackend:
    from transport.nixl.holder import NixlHolder  # imports NIXL only for a client that uses it

    return NixlHolder(store, verifier, host, 0).start()


def endpoints(tcp: str, backends: Sequence[HolderBackend]) -> dict[str, str]:
    """The endpoints a client advertises: {"tcp": tcp} and, for each other backend it
    serves, its kind's HOST:PORT (the host of `tcp`, the backend's port)."""
    found = {"tcp": tcp}
    host, _ = parse_endpoint(tcp)
    for backend in backends:
        if backend.kind.value not in found:
            found[backend.kind.value] = format_endpoint(host, backend.address[1])
    return found


def _start(
    kind: str, unavailable: str, tls: bool, start: Callable[[], HolderBackend]
) -> HolderBackend | None:
    """The `kind` backend started by `start`, or None (logged why): not available here
    (`unavailable`, the probe's reason), TLS on (neither channel is encrypted), or it
    cannot listen."""
    if unavailable:
        log.debug("advertising no %s: %s", kind, unavailable)
        return None
    if tls:
        log.info("advertising no %s: TLS is on and its control channel is not encrypted", kind)
        return None
    try:
        return start()
    except OSError as exc:
        log.warning("advertising no %s: cannot listen for its readers: %s", kind, exc)
        return None
