"""What a client's holder record advertises: one endpoint per transport it can serve.

TCP always (the holder server). RDMA too when `rdma_available()` says this machine has a
usable device: the client then starts an `RdmaControlServer` over the same store and
verifier as its TCP server, and advertises its `HOST:PORT` (same host as the tcp
endpoint) as the `rdma` endpoint. Queue-pair numbers, GIDs and keys are exchanged on that
channel per reader, never written into the record (tensorhub/endpoints.py). Same-host CUDA
IPC likewise when this process has a CUDA device (`ipc_available()`): an
`IpcControlServer`, advertised as `ipc`; it grants leases only on versions held in GPU
memory. A client with TLS advertises neither: their control channels (and one-sided
reads) are not encrypted, and a holder that requires TLS must not serve bytes without
it. Readers pick among what is advertised (`transport.selection`).
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass

from tensorhub.endpoints import format_endpoint, parse_endpoint
from transport.ipc import ipc_available, ipc_unavailable_reason
from transport.ipc.server import IpcControlServer
from transport.rdma import rdma_available, rdma_unavailable_reason
from transport.rdma.control import RdmaControlServer
from transport.store import HolderStore

log = logging.getLogger(__name__)

Verifier = Callable[[str, str, int, bytes], bool]


@dataclass
class _Served:
    """The control channels one client runs beside its TCP server (None: not served)."""

    rdma: RdmaControlServer | None
    ipc: IpcControlServer | None

    def stop(self) -> None:
        for server in (self.rdma, self.ipc):
            if server is not None:
                server.stop()


_lock = threading.Lock()
_servers: weakref.WeakKeyDictionary[object, _Served] = weakref.WeakKeyDictionary()


def served_endpoints(
    owner: object,
    tcp: str,
    store: HolderStore,
    verifier: Verifier,
    listen_host: str,
    *,
    tls: bool,
) -> dict[str, str]:
    """The endpoints `owner` (a client) advertises: {"tcp": tcp} and, where this machine
    can serve them, {"rdma": ..., "ipc": ...}, HOST:PORT of their control channels,
    started on first use."""
    endpoints = {"tcp": tcp}
    with _lock:
        if owner not in _servers:
            _servers[owner] = _Served(
                _start_rdma(store, verifier, listen_host, tls),
                _start_ipc(store, verifier, listen_host, tls),
            )
        served = _servers[owner]
    host, _ = parse_endpoint(tcp)
    if served.rdma is not None:
        endpoints["rdma"] = format_endpoint(host, served.rdma.address[1])
    if served.ipc is not None:
        endpoints["ipc"] = format_endpoint(host, served.ipc.address[1])
    return endpoints


def _start_rdma(
    store: HolderStore, verifier: Verifier, listen_host: str, tls: bool
) -> RdmaControlServer | None:
    if not rdma_available():
        log.debug("advertising no rdma: %s", rdma_unavailable_reason())
        return None
    if tls:
        log.info("advertising no rdma: TLS is on and RDMA reads are not encrypted")
        return None
    try:
        return RdmaControlServer(store, verifier, listen_host, 0).start()
    except OSError as exc:
        log.warning("advertising no rdma: cannot listen for RDMA readers: %s", exc)
        return None


def _start_ipc(
    store: HolderStore, verifier: Verifier, listen_host: str, tls: bool
) -> IpcControlServer | None:
    if not ipc_available():
        log.debug("advertising no ipc: %s", ipc_unavailable_reason())
        return None
    if tls:
        log.info("advertising no ipc: TLS is on and the IPC control channel is not encrypted")
        return None
    try:
        return IpcControlServer(store, verifier, listen_host, 0).start()
    except OSError as exc:
        log.warning("advertising no ipc: cannot listen for IPC readers: %s", exc)
        return None


def stop_served(owner: object) -> None:
    """Stop `owner`'s control channels, if it started any (at close)."""
    with _lock:
        served = _servers.pop(owner, None)
    if served is not None:
        served.stop()
