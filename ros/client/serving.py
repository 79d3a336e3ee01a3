"""What a client serves from: its holder server (TCP) and the control channels beside it
(RDMA, same-host CUDA IPC: `ros.client.advertise`), started explicitly by the first publish
or fetch that holds a version, stopped at close.

Starting is its own call (`start`), never a side effect of building a holder record: a
record names endpoints that must already be listening (`endpoints`).
"""

from __future__ import annotations

import socket
import threading

from ros.client.advertise import ControlChannels, Verifier
from ros.metrics import SDK_BYTES_SERVED
from tensorhub.endpoints import format_endpoint
from tensorhub.errors import InternalError
from transport.server import ChunkSender, HolderServer
from transport.store import HolderStore
from transport.tls import TlsConfig


class Serving:
    """One client's servers over its `HolderStore`. Thread-safe."""

    def __init__(
        self,
        store: HolderStore,
        verifier: Verifier,
        listen: tuple[str, int],
        *,
        advertise: str | None,
        tls: TlsConfig | None,
        send: ChunkSender,
    ) -> None:
        self._store, self._verifier = store, verifier
        self._listen, self._advertise = listen, advertise
        self._tls, self._send = tls, send
        self._lock = threading.Lock()
        self._server: HolderServer | None = None
        self._channels: ControlChannels | None = None
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
            channels = ControlChannels.start(
                self._store, self._verifier, host, tls=self._tls is not None
            )
            self._channels = channels
            self._endpoints = channels.endpoints(self._tcp_endpoint(server))

    @property
    def server(self) -> HolderServer:
        """The TCP holder server (`InternalError` before `start`)."""
        server = self._server
        if server is None:
            raise InternalError("this client serves nothing yet")
        return server

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
            if self._server is not None:
                self._server.stop()
            if self._channels is not None:
                self._channels.stop()
