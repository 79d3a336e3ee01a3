"""The holder side of RDMA (`transport.backend.HolderBackend`): the control channel, the
TCP connection over which a reader gets a descriptor.

A holder that serves RDMA listens on a TCP port of its own (the `rdma` endpoint of its
holder record, `HOST:PORT`). One connection per (reader, holder) queue pair:

1. reader → holder: a request (`encode_request`): tenant, model, version, layout digest,
   read token and the reader's `QpInfo`;
2. holder → reader: the `RdmaDescriptor` (`encode_descriptor`), or a refusal with a
   `transport.wire.ErrorCode` (`DENIED`, `NOT_HELD`, `RELEASED`, `NOT_READY`, ...), which
   the reader turns into the same typed `ChunkOutcome` a TCP ERROR frame gives;
3. the connection stays open while the reader reads; when it closes, or when the holder
   releases the version, the holder destroys that reader's queue pair.

Each message is a u32 big-endian length and that many bytes of UTF-8 JSON. The server
holds one read of the version (`HeldVersion.reading()`) per connected reader, so
`HolderStore.release` returns only after every queue pair that could read the memory is
gone: the mutability contract holds for one-sided reads too.
"""

from __future__ import annotations

import json
import select
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Unpack

from tensorhub.errors import TransportError, VersionUnavailable
from transport.admission import Conn
from transport.backend import TransportKind
from transport.frames import decode_json, send_message
from transport.listener import ControlServer, PortLimits
from transport.rdma.descriptor import (
    FORMAT,
    MAX_ENCODED_BYTES,
    QpInfo,
    RdmaDescriptor,
    decode_descriptor,
    encode_descriptor,
)
from transport.store import HeldVersion, HolderStore
from transport.verifier import Verifier
from transport.wire import ErrorCode, Refusal

MAX_REQUEST_BYTES = 64 * 1024


@dataclass(frozen=True)
class RdmaRequest:
    """What a reader asks the control channel for (step 1)."""

    tenant: str
    model: str
    version: int
    layout_digest: int
    token: bytes
    qp: QpInfo


def encode_request(req: RdmaRequest) -> bytes:
    """The request as JSON (the token hex-encoded)."""
    doc = {
        "format": FORMAT, "tenant": req.tenant, "model": req.model, "version": req.version,
        "layout": req.layout_digest, "token": req.token.hex(), "qp": req.qp.to_json(),
    }  # fmt: skip
    return json.dumps(doc, separators=(",", ":")).encode()


def _doc(data: bytes, limit: int) -> dict[str, Any]:
    return decode_json(data, limit, "RDMA control message", FORMAT)


def decode_request(data: bytes) -> RdmaRequest:
    """Parse and validate a request; `TransportError` on anything else."""
    doc = _doc(data, MAX_REQUEST_BYTES)
    try:
        tenant, model = doc["tenant"], doc["model"]
        version, digest, token = (
            doc["version"],
            doc["layout"],
            bytes.fromhex(doc["token"]),
        )
        qp = QpInfo.from_json(doc["qp"])
    except (KeyError, TypeError, ValueError) as ex:
        raise TransportError(f"RDMA control request is malformed: {ex!r}") from ex
    if not (isinstance(tenant, str) and isinstance(model, str)):
        raise TransportError("RDMA control request is malformed: tenant and model must be strings")
    if type(version) is not int or type(digest) is not int or version < 0 or digest < 0:
        raise TransportError(
            "RDMA control request is malformed: version and layout must be integers >= 0"
        )
    return RdmaRequest(tenant, model, version, digest, token, qp)


def encode_refusal(code: ErrorCode, message: str) -> bytes:
    """A refusal (step 2, the holder says no)."""
    doc = {"format": FORMAT, "error": {"code": int(code), "message": message[:1024]}}
    return json.dumps(doc, separators=(",", ":")).encode()


def decode_reply(data: bytes) -> RdmaDescriptor | Refusal:
    """The holder's answer: its descriptor, or a `Refusal` with a typed code."""
    doc = _doc(data, MAX_ENCODED_BYTES)
    error = doc.get("error")
    if error is None:
        return decode_descriptor(data)
    if not isinstance(error, dict) or type(error.get("code")) is not int:
        raise TransportError("RDMA control refusal has no integer code")
    raw = int(error["code"])
    code = ErrorCode(raw) if raw in ErrorCode._value2member_map_ else None
    return Refusal(code, raw, str(error.get("message", "")))


class RdmaControlServer(ControlServer):
    """Serves descriptors for the versions in `store` to RDMA readers whose token
    `verifier` accepts. The device is opened on the first request that needs it
    (`device_factory`, default `RdmaDevice()`), so refusals need no device; one
    `RdmaExporter` per held version, closed once the version is released and its last
    reader has gone. Admission and the accept loop are `transport.listener`'s: the same
    rules as the TCP data port (a slowloris is cut at the frame deadline)."""

    name = "rdma-control"
    kind = TransportKind.RDMA

    def __init__(
        self,
        store: HolderStore,
        verifier: Verifier,
        host: str = "127.0.0.1",
        port: int = 0,
        device_factory: Callable[[], Any] | None = None,
        **limits: Unpack[PortLimits],
    ) -> None:
        super().__init__(store, verifier, host, port, **limits)
        self._device_factory = device_factory
        self._device: Any = None
        self._exporters: dict[int, tuple[HeldVersion, Any, int]] = {}  # id -> (held, exp, readers)

    def stop(self) -> None:
        """Stop accepting, close every exporter (destroying its readers' queue pairs)."""
        super().stop()
        with self._lock:
            exporters, self._exporters = self._exporters, {}
            device, self._device = self._device, None
        for _, exporter, _ in exporters.values():
            exporter.close()
        if device is not None:
            device.close()

    def register(self, held: HeldVersion) -> None:
        """Nothing yet: `held`'s memory is registered with the NIC for the first reader
        whose token passes (`_enter`), so a holder no RDMA reader asks opens no device."""

    def release(self, held: HeldVersion) -> None:
        """Close `held`'s exporter once its last reader is gone (the release waited for
        them, or gave up: then the next tick closes it after they leave)."""
        self.tick()

    def refusal(self, code: ErrorCode, message: str) -> bytes:
        return encode_refusal(code, message)

    def tick(self) -> None:
        """Close the exporters of released versions that no reader uses any more."""
        with self._lock:
            idle = [k for k, (h, _, n) in self._exporters.items() if h.released and n == 0]
            gone = [self._exporters.pop(k)[1] for k in idle]
        for exporter in gone:
            exporter.close()

    def serve(self, record: Conn) -> None:
        req = self.request(record, decode_request, MAX_REQUEST_BYTES)
        if req is not None:
            self._answer(record.sock, req, record)

    def _answer(self, conn: socket.socket, req: RdmaRequest, record: Conn) -> None:
        key = (req.tenant, req.model, req.version)
        on_cuda = "on CUDA (RDMA serves CPU memory)"
        held = self.offered(record, key, req.token, req.layout_digest, on_cuda=on_cuda)
        if held is None:
            return
        try:
            with held.reading():  # counted until this reader's queue pair is gone
                exporter = self._enter(held)
                try:
                    desc = exporter.accept(req.qp)
                    try:
                        send_message(conn, encode_descriptor(desc))
                        self._hold(conn, held)
                    finally:  # from here on this reader's NIC cannot read our memory
                        exporter.disconnect(desc.qp.qpn)
                finally:
                    self._leave(held)
        except VersionUnavailable as exc:
            self.refuse(conn, ErrorCode.RELEASED, str(exc))
        except TransportError as exc:  # no device, overwriting, a verbs failure
            self.refuse(conn, ErrorCode.BAD_REQUEST, str(exc))

    def _enter(self, held: HeldVersion) -> Any:
        with self._lock:
            entry = self._exporters.get(id(held))
            if entry is None:
                from transport.rdma.device import RdmaDevice
                from transport.rdma.exporter import RdmaExporter

                if self._device is None:
                    factory = self._device_factory or RdmaDevice
                    self._device = factory()
                exporter = RdmaExporter(self._device, held.tensors, version=held.key[2])
                entry = (held, exporter, 0)
            self._exporters[id(held)] = (entry[0], entry[1], entry[2] + 1)
            return entry[1]

    def _leave(self, held: HeldVersion) -> None:
        with self._lock:
            entry = self._exporters.get(id(held))
            if entry is not None:
                self._exporters[id(held)] = (entry[0], entry[1], entry[2] - 1)
        self.tick()

    def _hold(self, conn: socket.socket, held: HeldVersion) -> None:
        """Wait until the reader closes the channel, the version is released, or we stop."""
        while not (held.released or self.stopping.is_set()):
            ready, _, _ = select.select([conn], [], [], 0.05)
            if ready and not conn.recv(1):
                return
