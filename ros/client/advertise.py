"""What a client's holder record advertises: one endpoint per transport it can serve.

TCP always (the holder server). RDMA too when `rdma_available()` says this machine has a
usable device: the client then starts an `RdmaControlServer` over the same store and
verifier as its TCP server (`ControlChannels`), and advertises its `HOST:PORT` (same host as the tcp
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
class ControlChannels:
    """The control channels one client runs beside its TCP server (None: not served)."""

    rdma: RdmaControlServer | None
    ipc: IpcControlServer | None

    @classmethod
    def start(
        cls, store: HolderStore, verifier: Verifier, listen_host: str, *, tls: bool
    ) -> ControlChannels:
        """Start every control channel this machine can serve over `store`."""
        no_rdma = "" if rdma_available() else rdma_unavailable_reason() or "no device"
        return cls(
            _start(
                "rdma", no_rdma, tls,
                lambda: RdmaControlServer(store, verifier, listen_host, 0).start(),
            ),
            _start(
                "ipc", ipc_unavailable_reason(), tls,
                lambda: IpcControlServer(store, verifier, listen_host, 0).start(),
            ),
        )  # fmt: skip

    def endpoints(self, tcp: str) -> dict[str, str]:
        """The endpoints a client advertises: {"tcp": tcp} and, where this machine serves
        them, {"rdma": ..., "ipc": ...}, HOST:PORT of their control channels."""
        endpoints = {"tcp": tcp}
        host, _ = parse_endpoint(tcp)
        if self.rdma is not None:
            endpoints["rdma"] = format_endpoint(host, self.rdma.address[1])
        if self.ipc is not None:
            endpoints["ipc"] = format_endpoint(host, self.ipc.address[1])
        return endpoints

    def stop(self) -> None:
        for server in (self.rdma, self.ipc):
            if server is not None:
                server.stop()


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
