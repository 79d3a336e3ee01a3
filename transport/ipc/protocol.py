"""The same-host CUDA IPC control channel's messages, and their validated JSON form.

One TCP connection per (reader, holder) lease, on the holder's `ipc` endpoint:

1. reader → holder, `IpcRequest`: tenant, model, version, layout digest, read token, and the
   reader's `HostFingerprint`;
2. holder → reader, an `IpcGrant` (or a refusal with a `transport.wire.ErrorCode`): its own
   fingerprint, the GPU the memory is on (by UUID: device numbers differ between processes
   with different CUDA_VISIBLE_DEVICES), one CUDA IPC memory handle per storage, each
   tensor's place in its storage, a CUDA IPC event recorded after the holder's last write
   of the memory, the version's epoch, and a probe (one chunk's wsum64, computed by the
   holder) that proves the mapping shows the holder's bytes;
3. reader → holder, `Report` after each copy ("done with a batch"; `final` ends the lease);
   holder → reader, `Ack`: the epoch now and whether the version is being released. The
   reader keeps a batch only when that epoch is the one of the grant (`seqlock.epoch_ok`).

Messages are length-prefixed JSON (`transport.frames`). Decoding checks every field's type
and range and raises `TransportError`, so a garbled or hostile peer never reaches a CUDA
call with a value it made up.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tensorhub.errors import TransportError
from transport.frames import decode_json
from transport.ipc.fingerprint import HostFingerprint
from transport.wire import ErrorCode, Refusal

FORMAT = "tensorhub.ipc/1"
MAX_REQUEST_BYTES = 64 * 1024
MAX_GRANT_BYTES = 32 << 20  # ~200k tensors; bounds what one peer can make another parse
MAX_SMALL_BYTES = 4096  # reports and acks
_U64 = (1 << 64) - 1
_HANDLE_HEX = 1024  # a cudaIpcMemHandle is 64 bytes; torch's handle and counter names are short


def _int(value: object, field: str, low: int = 0, high: int = _U64) -> int:
    if type(value) is not int or not low <= value <= high:  # JSON true must not pass as 1
        raise TransportError(f"IPC message: {field} must be an integer in [{low}, {high}]")
    return value


def _hex(value: object, field: str) -> bytes:
    if not isinstance(value, str) or len(value) > _HANDLE_HEX:
        raise TransportError(f"IPC message: {field} must be a hex string")
    try:
        return bytes.fromhex(value)
    except ValueError as exc:
        raise TransportError(f"IPC message: {field} is not hex") from exc


def _str(value: object, field: str, limit: int = 256) -> str:
    if not isinstance(value, str) or len(value) > limit:
        raise TransportError(f"IPC message: {field} must be a string of at most {limit}")
    return value


def _doc(data: bytes, limit: int) -> dict[str, Any]:
    return decode_json(data, limit, "IPC message", FORMAT)


def _dump(doc: dict[str, Any]) -> bytes:
    return json.dumps({"format": FORMAT, **doc}, separators=(",", ":")).encode()


@dataclass(frozen=True)
class IpcRequest:
    """Step 1: what a reader asks for."""

    tenant: str
    model: str
    version: int
    layout_digest: int
    token: bytes
    host: HostFingerprint

    def encode(self) -> bytes:
        return _dump({
            "tenant": self.tenant, "model": self.model, "version": self.version,
            "layout": self.layout_digest, "token": self.token.hex(), "host": self.host.to_json(),
        })  # fmt: skip

    @classmethod
    def decode(cls, data: bytes) -> IpcRequest:
        doc = _doc(data, MAX_REQUEST_BYTES)
        try:
            return cls(
                _str(doc["tenant"], "tenant"),
                _str(doc["model"], "model"),
                _int(doc["version"], "version"),
                _int(doc["layout"], "layout"),
                _hex(doc["token"], "token"),
                HostFingerprint.from_json(doc["host"]),
            )
        except KeyError as exc:
            raise TransportError(f"IPC request: {exc} is missing") from exc


@dataclass(frozen=True)
class Storage:
    """One CUDA allocation the holder shares: torch's `UntypedStorage._share_cuda_()`
    fields, without the device number (the grant names the GPU by UUID)."""

    handle: bytes
    size: int
    offset: int
    ref_counter: bytes
    ref_counter_offset: int
    event: bytes
    event_sync_required: bool

    def to_json(self) -> list[Any]:
        return [
            self.handle.hex(), self.size, self.offset, self.ref_counter.hex(),
            self.ref_counter_offset, self.event.hex(), self.event_sync_required,
        ]  # fmt: skip

    @classmethod
    def from_json(cls, value: object) -> Storage:
        if not isinstance(value, list) or len(value) != 7 or type(value[6]) is not bool:
            raise TransportError("IPC grant: a storage is not [handle, size, ..., sync]")
        return cls(
            _hex(value[0], "storage handle"), _int(value[1], "storage size"),
            _int(value[2], "storage offset"), _hex(value[3], "ref counter"),
            _int(value[4], "ref counter offset"), _hex(value[5], "storage event"), value[6],
        )  # fmt: skip


@dataclass(frozen=True)
class IpcGrant:
    """Step 2: how to map the version. `places[i]` is (storage index, byte offset in that
    storage) of the layout's i-th tensor; its length is the layout's. `probe` is
    (chunk index, wsum64 of that chunk as the holder sees it)."""

    host: HostFingerprint
    device_uuid: str
    epoch: int
    event: bytes
    storages: tuple[Storage, ...]
    places: tuple[tuple[int, int], ...]
    probe: tuple[int, int]

    def encode(self) -> bytes:
        return _dump({
            "host": self.host.to_json(), "device": self.device_uuid, "epoch": self.epoch,
            "event": self.event.hex(), "storages": [s.to_json() for s in self.storages],
            "places": [list(p) for p in self.places], "probe": list(self.probe),
        })  # fmt: skip

    @classmethod
    def decode(cls, doc: dict[str, Any]) -> IpcGrant:
        try:
            storages = doc["storages"]
            places, probe = doc["places"], doc["probe"]
            if not (isinstance(storages, list) and isinstance(places, list)):
                raise TransportError("IPC grant: storages and places must be lists")
            if not isinstance(probe, list) or len(probe) != 2:
                raise TransportError("IPC grant: probe must be [chunk, wsum64]")
            parsed = tuple(Storage.from_json(s) for s in storages)
            where = []
            for p in places:
                if not isinstance(p, list) or len(p) != 2:
                    raise TransportError("IPC grant: a place must be [storage, offset]")
                where.append(
                    (_int(p[0], "place storage", 0, max(0, len(parsed) - 1)), _int(p[1], "offset"))
                )
            return cls(
                HostFingerprint.from_json(doc["host"]),
                _str(doc["device"], "device"),
                _int(doc["epoch"], "epoch"),
                _hex(doc["event"], "event"),
                parsed,
                tuple(where),
                (_int(probe[0], "probe chunk"), _int(probe[1], "probe sum")),
            )
        except KeyError as exc:
            raise TransportError(f"IPC grant: {exc} is missing") from exc


def encode_refusal(code: ErrorCode, message: str) -> bytes:
    """Step 2, the holder says no."""
    return _dump({"error": {"code": int(code), "message": message[:1024]}})


def decode_reply(data: bytes) -> IpcGrant | Refusal:
    """The holder's answer to a request: its grant, or a `Refusal` with a typed code."""
    doc = _doc(data, MAX_GRANT_BYTES)
    error = doc.get("error")
    if error is None:
        return IpcGrant.decode(doc)
    if not isinstance(error, dict) or type(error.get("code")) is not int:
        raise TransportError("IPC refusal has no integer code")
    raw = int(error["code"])
    code = ErrorCode(raw) if raw in ErrorCode._value2member_map_ else None
    return Refusal(code, raw, str(error.get("message", "")))


@dataclass(frozen=True)
class Report:
    """Step 3, reader → holder: `copied` chunks are copied out; `final` ends the lease."""

    copied: int
    final: bool = False

    def encode(self) -> bytes:
        return _dump({"copied": self.copied, "final": self.final})

    @classmethod
    def decode(cls, data: bytes) -> Report:
        doc = _doc(data, MAX_SMALL_BYTES)
        final = doc.get("final", False)
        if type(final) is not bool:
            raise TransportError("IPC report: final must be true or false")
        return cls(_int(doc.get("copied"), "copied"), final)


@dataclass(frozen=True)
class Ack:
    """Step 3, holder → reader: the version's epoch now; `released`: no more reports are
    taken on this lease (the holder is releasing the version, or the lease ended)."""

    epoch: int
    released: bool

    def encode(self) -> bytes:
        return _dump({"epoch": self.epoch, "released": self.released})

    @classmethod
    def decode(cls, data: bytes) -> Ack:
        doc = _doc(data, MAX_SMALL_BYTES)
        released = doc.get("released")
        if type(released) is not bool:
            raise TransportError("IPC ack: released must be true or false")
        return cls(_int(doc.get("epoch"), "epoch"), released)
