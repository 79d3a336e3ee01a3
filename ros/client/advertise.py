"""What a client's holder record advertises: one endpoint per transport it can serve.

TCP always (the holder server). RDMA too when `rdma_available()` says this machine has a
usable device: the client then starts an `RdmaControlServer` over the same store and
verifier as its TCP server, and advertises its `HOST:PORT` (same host as the tcp
endpoint) as the `rdma` endpoint. Queue-pair numbers, GIDs and keys are exchanged on that
channel per reader, never written into the record (tensorhub/endpoints.py). Same-host CUDA
IPC likewise when this process has a CUDA device (`ipc_unavailable_reason()` is empty): an
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
from typing import TypeVar

from tensorhub.endpoints import format_endpoint, parse_endpoint
from transport.ipc import ipc_unavailable_reason
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
            no_rdma = "" if rdma_available() else rdma_unavailable_reason() or "no device"
            _servers[owner] = _Served(
                _start(
                    "rdma", no_rdma, tls,
                    lambda: RdmaControlServer(store, verifier, listen_host, 0).start(),
                ),
                _start(
                    "ipc", ipc_unavailable_reason(), tls,
                    lambda: IpcControlServer(store, verifier, listen_host, 0).start(),
                ),
            )  # fmt: skip
        served = _servers[owner]
    host, _ = parse_endpoint(tcp)
    if served.rdma is not None:
        endpoints["rdma"] = format_endpoint(host, served.rdma.address[1])
    if served.ipc is not None:
        endpoints["ipc"] = format_endpoint(host, served.ipc.address[1])
    return endpoints


S = TypeVar("S", RdmaControlServer, IpcControlServer)


def _start(kind: str, unavailable: str, tls: bool, start: Callable[[], S]) -> S | None:
    """The `kind` control channel started by `start`, or None (logged why): not available
    here (`unavailable`, the probe's reason), TLS on (neither channel is encrypted), or it
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


def stop_served(owner: object) -> None:
    """Stop `owner`'s control channels, if it started any (at close)."""
    with _lock:
        served = _servers.pop(owner, None)
    if served is not None:
        served.stop()
