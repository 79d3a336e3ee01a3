"""What a client's holder record advertises: one endpoint per transport it can serve.

TCP always (the holder server). RDMA too when `rdma_available()` says this machine has a
usable device: the client then starts an `RdmaControlServer` over the same store and
verifier as its TCP server, and advertises its `HOST:PORT` (same host as the tcp
endpoint) as the `rdma` endpoint. Queue-pair numbers, GIDs and keys are exchanged on that
channel per reader, never written into the record (tensorhub/endpoints.py). A client with
TLS advertises no RDMA: its control channel and one-sided reads are not encrypted, and a
holder that requires TLS must not serve bytes without it. Readers pick among what is
advertised (`transport.selection`).
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable

from tensorhub.endpoints import format_endpoint, parse_endpoint
from transport.rdma import rdma_available, rdma_unavailable_reason
from transport.rdma.control import RdmaControlServer
from transport.store import HolderStore

log = logging.getLogger(__name__)

_lock = threading.Lock()
_servers: weakref.WeakKeyDictionary[object, RdmaControlServer | None] = weakref.WeakKeyDictionary()


def served_endpoints(
    owner: object,
    tcp: str,
    store: HolderStore,
    verifier: Callable[[str, str, int, bytes], bool],
    listen_host: str,
    *,
    tls: bool,
) -> dict[str, str]:
    """The endpoints `owner` (a client) advertises: {"tcp": tcp} and, where this machine
    can serve it, {"rdma": HOST:PORT of its control channel}, started on first use."""
    endpoints = {"tcp": tcp}
    with _lock:
        if owner not in _servers:
            _servers[owner] = _start(store, verifier, listen_host, tls)
        server = _servers[owner]
    if server is not None:
        host, _ = parse_endpoint(tcp)
        endpoints["rdma"] = format_endpoint(host, server.address[1])
    return endpoints


def _start(
    store: HolderStore,
    verifier: Callable[[str, str, int, bytes], bool],
    listen_host: str,
    tls: bool,
) -> RdmaControlServer | None:
    if not rdma_available():
        log.debug("advertising tcp only: %s", rdma_unavailable_reason())
        return None
    if tls:
        log.info("advertising tcp only: TLS is on and RDMA reads are not encrypted")
        return None
    try:
        return RdmaControlServer(store, verifier, listen_host, 0).start()
    except OSError as exc:
        log.warning("advertising tcp only: cannot listen for RDMA readers: %s", exc)
        return None


def stop_served(owner: object) -> None:
    """Stop `owner`'s RDMA control channel, if it started one (at close)."""
    with _lock:
        server = _servers.pop(owner, None)
    if server is not None:
        server.stop()
