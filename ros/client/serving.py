"""What a client serves from: its holder backends (`transport.backend.HolderBackend`), the
TCP holder server and the control channels beside it (NIXL, RDMA, same-host CUDA IPC:
`ros.client.advertise`), started explicitly by the first publish or fetch that holds a
version, stopped at close. Each is this client's own: two clients in one process share
no server, and closing one leaves the other serving.

Starting is its own call (`start`), never a side effect of building a holder record: a
record names endpoints that must already be listening (`endpoints`). Once started, every
backend hears of each version the store serves and of each release
(`HolderStore.watch`): register, release.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Sequence

from ros.client.advertise import control_backends
from ros.client.advertise import endpoints as advertised
from ros.metrics import SDK_BYTES_SERVED
from tensorhub.endpoints import format_endpoint
from tensorhub.errors import InternalError
from transport.backend import HolderBackend, TransportKind
from transport.server import ChunkSender, HolderServer
from transport.store import HolderStore
from transport.tls import TlsConfig
from transport.verifier import Verifier


class Serving:
    """One client's holder backends over its `HolderStore`. Thread-safe."""

    def __init__(
        self,
        store: HolderStore,
        verifier: Verifier,
        listen: tuple[str, int],
        *,
        advertise: str | None,
        tls: TlsConfig | None,
        send: ChunkSender,
        kinds: Sequence[TransportKind] = (TransportKind.RDMA, TransportKind.IPC, TransportKind.TCP),
    ) -> None:
        self._store, self._verifier = store, verifier
        self._kinds = tuple(kinds)  # what it serves beside TCP, where the machine can
        self._listen, self._advertise = listen, advertise
        self._tls, self._send = tls, send
        self._lock = threading.Lock()
        self._server: HolderServer | None = None
        self._backends: list[HolderBackend] = []
        self._endpoints: dict[str, str] | None = None

    def start(self) -> None:
        """Listen, if not yet: the TCP holder server, then the control channels."""
        with self._lock:
            if self._server is not None:
                return
            host, port = self._listen
            server = HolderServer(
                self._store, self._verifier, host, port, tls=self._tls,
                on_served=SDK_BYTES_SERVED.inc, send=self._send,
            ).start()  # fmt: skip
            self._server = server
            others = control_backends(
                self._store, self._verifier, host, tls=self._tls is not None, kinds=self._kinds
            )
            self._backends = [server, *others]
            for backend in self._backends:
                self._store.watch(backend.register, backend.release)
            self._endpoints = advertised(self._tcp_endpoint(server), others)

    @property
    def server(self) -> HolderServer:
        """The TCP holder server (`InternalError` before `start`)."""
        server = self._server
        if server is None:
            raise InternalError("this client serves nothing yet")
        return server

    @property
    def backends(self) -> list[HolderBackend]:
        """The holder backends serving now, TCP first (none before `start`)."""
        with self._lock:
            return list(self._backends)

    def endpoints(self) -> dict[str, str]:
        """What a holder record advertises: one endpoint per transport served."""
        endpoints = self._endpoints
        if endpoints is None:
            raise InternalError("a holder record was built before the client served anything")
        return dict(endpoints)

    def _tcp_endpoint(self, server: HolderServer) -> str:
        host, port = server.address
        if self._advertise:
            host = self._advertise
        elif host in ("0.0.0.0", "::"):
            host = socket.gethostbyname(socket.gethostname())
        return format_endpoint(host, port)  # an IPv6 host bracketed, as readers parse it

    def stop(self) -> None:
        with self._lock:
            backends = list(self._backends)
        for backend in backends:
            backend.stop()
