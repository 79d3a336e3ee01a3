"""The holder side of same-host CUDA IPC (`transport.backend.HolderBackend`): grant
leases on held versions' GPU memory.

A reader connects to the holder's `ipc` endpoint and sends an `IpcRequest`. Before anything
of the memory is shared, the request's read token must pass the holder's verifier (the same
one as the TCP port's), the version must be held here, COMPLETE, not released, laid out as
the reader expects, and in GPU memory; otherwise the reader gets a refusal with its
`ErrorCode` (NOT_READY for "not here over IPC: read over TCP").

A granted lease counts as one read of the version (`HeldVersion.reading()`) from the grant
until the reader's final report, its silence for `lease_idle` seconds, or its disconnect.
So releasing a version (`HolderStore.release`) refuses new leases at once and then waits,
within its own timeout, for every reader to report its copy done: the memory does not change
under a copy that reports in time. Each report is answered with the version's epoch; once a
release has returned or given up waiting, the epoch is odd and a reader whose copy was still
running drops it (`HeldVersion.epoch`, the RDMA seqlock's rule).
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Unpack

from tensorhub.errors import IpcIneligible, TransportError, VersionUnavailable
from transport.admission import Conn
from transport.backend import TransportKind
from transport.frames import recv_message, send_message
from transport.ipc.cuda import Export, export, probe_sum
from transport.ipc.protocol import (
    MAX_GRANT_BYTES,
    MAX_REQUEST_BYTES,
    MAX_SMALL_BYTES,
    Ack,
    IpcRequest,
    Report,
    encode_refusal,
)
from transport.listener import ControlServer, PortLimits
from transport.store import HeldVersion, HolderStore
from transport.verifier import Verifier
from transport.wire import ErrorCode

LEASE_IDLE = 30.0  # the longest a reader may take between reports before its lease ends

Exporter = Callable[[HeldVersion, int], Export]
"""`(held, probe sum) -> Export`: share `held` for one lease (`transport.ipc.cuda.export`)."""


class IpcControlServer(ControlServer):
    """Grants CUDA IPC leases on the versions of `store` to readers whose token `verifier`
    accepts (module docstring). `exporter` shares the memory (default: CUDA's); `leases`
    is the number granted and not ended, for metrics and tests."""

    name = "ipc-control"
    kind = TransportKind.IPC

    def __init__(
        self,
        store: HolderStore,
        verifier: Verifier,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        exporter: Exporter = export,
        lease_idle: float = LEASE_IDLE,
        **limits: Unpack[PortLimits],
    ) -> None:
        super().__init__(store, verifier, host, port, **limits)
        self._exporter = exporter
        self._lease_idle = lease_idle
        self._probes: dict[int, tuple[HeldVersion, int]] = {}
        self.leases = 0

    def register(self, held: HeldVersion) -> None:
        """Nothing yet: `held`'s GPU memory is exported per lease, to a reader whose token
        passed (`serve`)."""

    def release(self, held: HeldVersion) -> None:
        """Forget `held`'s probe sum (its leases ended with the release)."""
        self.tick()

    def refusal(self, code: ErrorCode, message: str) -> bytes:
        return encode_refusal(code, message)

    def tick(self) -> None:
        """Forget the probes of released versions."""
        with self._lock:
            for key in [k for k, (h, _) in self._probes.items() if h.released]:
                del self._probes[key]

    def serve(self, record: Conn) -> None:
        req = self.request(record, IpcRequest.decode, MAX_REQUEST_BYTES)
        if req is None:
            return
        key = (req.tenant, req.model, req.version)
        found = self.offered(record, key, req.token, req.layout_digest)
        if found is None:
            return
        conn = record.sock
        try:
            with found.reading():  # counted until the lease ends: release waits for it
                try:
                    granted = self._exporter(found, self._probe(found))
                except IpcIneligible as exc:
                    self.refuse(conn, ErrorCode.NOT_READY, f"{exc}: read over tcp")
                    return
                encoded = granted.grant.encode()
                if len(encoded) > MAX_GRANT_BYTES:  # a reader would refuse to parse it
                    why = f"a grant of {len(granted.grant.storages)} storages is too large"
                    self.refuse(conn, ErrorCode.NOT_READY, f"{why}: read over tcp")
                    return
                with self._lock:
                    self.leases += 1
                try:
                    send_message(conn, encoded)
                    self._hold(conn, found)
                finally:
                    with self._lock:
                        self.leases -= 1
                del granted  # the lease is over: the event it named may go
        except VersionUnavailable as exc:
            self.refuse(conn, ErrorCode.RELEASED, str(exc))
        except TransportError as exc:
            self.refuse(conn, ErrorCode.BAD_REQUEST, str(exc))

    def _probe(self, held: HeldVersion) -> int:
        """wsum64 of chunk 0 of `held`, computed once per held version."""
        with self._lock:
            entry = self._probes.get(id(held))
        if entry is not None and entry[0] is held:
            return entry[1]
        value = probe_sum(held)
        with self._lock:
            self._probes[id(held)] = (held, value)
        return value

    def _hold(self, conn: socket.socket, held: HeldVersion) -> None:
        """Answer the lease's reports with the epoch until the final one, a release, the
        reader's silence for `lease_idle`, its disconnect, or our stop."""
        conn.settimeout(self._lease_idle)
        while not self.stopping.is_set():
            try:
                report = Report.decode(recv_message(conn, MAX_SMALL_BYTES))
            except (TransportError, OSError):
                return  # gone, garbled or silent: the lease ends
            done = held.released or report.final
            send_message(conn, Ack(held.epoch, done).encode())
            if done:
                return
