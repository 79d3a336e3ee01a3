"""What a reader needs to read a holder's memory, and its JSON form for the TCP control channel.

Connecting two RC queue pairs needs one exchange each way, carried by the TCP data plane:

1. the reader sends its `QpInfo` (`encode_endpoint`), so that the holder can create a queue
   pair dedicated to this reader and move it to RTS;
2. the holder answers with an `RdmaDescriptor` (`encode_descriptor`): its queue pair's
   `QpInfo`, each tensor's memory region (address, rkey, length) and the epoch word.

Decoding validates every field (types, ranges, duplicates) and raises `TransportError` on
anything else, so that a garbled or hostile peer can never reach the verbs calls.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from typing import Any

from tensorhub.errors import TransportError

FORMAT = "tensorhub.rdma/1"
MAX_ENCODED_BYTES = 32 << 20  # ~200k regions; bounds what one peer can make another parse
MTU_BYTES = (256, 512, 1024, 2048, 4096)
_GID = re.compile(r"[0-9a-f]{4}(?::[0-9a-f]{4}){7}")
_U64 = (1 << 64) - 1
_U32 = (1 << 32) - 1
_U24 = (1 << 24) - 1
_U16 = (1 << 16) - 1


def _int(value: object, field: str, low: int, high: int) -> int:
    # bool is an int subclass; JSON true must not pass as 1.
    if type(value) is not int or not low <= value <= high:
        raise TransportError(f"RDMA descriptor: {field} must be an integer in [{low}, {high}]")
    return value


def _str(value: object, field: str) -> str:
    if not isinstance(value, str) or not value:
        raise TransportError(f"RDMA descriptor: {field} must be a non-empty string")
    return value


def _obj(value: object, field: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise TransportError(f"RDMA descriptor: {field} must be an object")
    return value


def _get(obj: dict[str, Any], key: str, where: str) -> object:
    if key not in obj:
        raise TransportError(f"RDMA descriptor: {where}{key} is missing")
    return obj[key]


@dataclass(frozen=True)
class QpInfo:
    """How to reach one RC queue pair; the remote half of the RTR transition.

    Attributes:
        qpn: queue pair number (24 bits).
        psn: the packet sequence number this side starts sending with (24 bits).
        lid: port LID (InfiniBand; 0 on RoCE).
        gid: port GID, 8 groups of 4 lowercase hex digits (RoCE needs it; IB may route by it).
        port: the physical port number on its device.
        mtu: active path MTU in bytes (256..4096); the pair uses the smaller of both sides.
    """

    qpn: int
    psn: int
    lid: int
    gid: str
    port: int
    mtu: int

    def __post_init__(self) -> None:
        _int(self.qpn, "qp.qpn", 0, _U24)
        _int(self.psn, "qp.psn", 0, _U24)
        _int(self.lid, "qp.lid", 0, _U16)
        _int(self.port, "qp.port", 1, 255)
        if self.mtu not in MTU_BYTES or type(self.mtu) is not int:
            raise TransportError(f"RDMA descriptor: qp.mtu must be one of {MTU_BYTES}")
        if not isinstance(self.gid, str) or not _GID.fullmatch(self.gid):
            raise TransportError("RDMA descriptor: qp.gid must look like 'fe80:0000:...' (8x4 hex)")

    def to_json(self) -> dict[str, Any]:
        """The JSON object form (field names as attributes)."""
        return {
            "qpn": self.qpn,
            "psn": self.psn,
            "lid": self.lid,
            "gid": self.gid,
            "port": self.port,
            "mtu": self.mtu,
        }

    @classmethod
    def from_json(cls, value: object, where: str = "qp.") -> QpInfo:
        """Parse and validate the JSON object form."""
        obj = _obj(value, where.rstrip("."))
        return cls(
            qpn=_int(_get(obj, "qpn", where), where + "qpn", 0, _U24),
            psn=_int(_get(obj, "psn", where), where + "psn", 0, _U24),
            lid=_int(_get(obj, "lid", where), where + "lid", 0, _U16),
            gid=_str(_get(obj, "gid", where), where + "gid"),
            port=_int(_get(obj, "port", where), where + "port", 1, 255),
            mtu=_int(_get(obj, "mtu", where), where + "mtu", 256, 4096),
        )


@dataclass(frozen=True)
class RegionInfo:
    """One registered tensor: where it is in the holder's address space and its remote key."""

    name: str
    addr: int
    rkey: int
    length: int

    def __post_init__(self) -> None:
        _str(self.name, "regions[].name")
        _int(self.addr, "regions[].addr", 0, _U64)
        _int(self.rkey, "regions[].rkey", 0, _U32)
        _int(self.length, "regions[].length", 0, _U64)
        if self.addr + self.length > _U64 + 1:
            raise TransportError(f"RDMA descriptor: region {self.name!r} wraps the address space")


@dataclass(frozen=True)
class RdmaDescriptor:
    """Everything one reader needs to read one held version with one-sided RDMA reads.

    Attributes:
        version: the version these regions hold; a reader never accepts another.
        epoch: the (even) epoch the version is served under; see `seqlock`.
        epoch_addr, epoch_rkey: where the holder's 8-byte epoch word is.
        regions: one per tensor, names unique.
        qp: the holder's queue pair dedicated to this reader.
    """

    version: int
    epoch: int
    epoch_addr: int
    epoch_rkey: int
    regions: tuple[RegionInfo, ...]
    qp: QpInfo

    def __post_init__(self) -> None:
        _int(self.version, "version", 0, _U64)
        _int(self.epoch, "epoch.value", 0, _U64)
        if self.epoch % 2:
            raise TransportError("RDMA descriptor: epoch.value is odd (holder mid-overwrite)")
        _int(self.epoch_addr, "epoch.addr", 1, _U64 - 7)
        _int(self.epoch_rkey, "epoch.rkey", 0, _U32)
        names = [r.name for r in self.regions]
        if len(set(names)) != len(names):
            raise TransportError("RDMA descriptor: region names are not unique")

    def region(self, name: str) -> RegionInfo:
        """The region called `name`; `TransportError` if the holder did not advertise it."""
        for r in self.regions:
            if r.name == name:
                return r
        raise TransportError(f"RDMA descriptor: no region named {name!r}")


def encode_descriptor(desc: RdmaDescriptor) -> bytes:
    """The descriptor as compact UTF-8 JSON, for the TCP control channel."""
    doc = {
        "format": FORMAT,
        "byteorder": sys.byteorder,
        "version": desc.version,
        "epoch": {"value": desc.epoch, "addr": desc.epoch_addr, "rkey": desc.epoch_rkey},
        "regions": [
            {"name": r.name, "addr": r.addr, "rkey": r.rkey, "length": r.length}
            for r in desc.regions
        ],
        "qp": desc.qp.to_json(),
    }
    return json.dumps(doc, separators=(",", ":")).encode()


def _load(data: bytes) -> dict[str, Any]:
    if not isinstance(data, bytes | bytearray | memoryview):
        raise TransportError("RDMA descriptor: expected bytes")
    if len(data) > MAX_ENCODED_BYTES:
        raise TransportError(f"RDMA descriptor: {len(data)} bytes is over {MAX_ENCODED_BYTES}")
    try:
        doc = json.loads(bytes(data).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as ex:
        raise TransportError(f"RDMA descriptor: not JSON ({ex})") from ex
    doc = _obj(doc, "document")
    if doc.get("format") != FORMAT:
        raise TransportError(f"RDMA descriptor: format is not {FORMAT!r}")
    return doc


def decode_descriptor(data: bytes) -> RdmaDescriptor:
    """Parse and validate `encode_descriptor`'s output; `TransportError` on anything else."""
    doc = _load(data)
    # The epoch's parity and equality are read as a native 64-bit word on both hosts.
    if doc.get("byteorder") != sys.byteorder:
        raise TransportError(f"RDMA descriptor: byteorder is not this host's ({sys.byteorder})")
    epoch = _obj(_get(doc, "epoch", ""), "epoch")
    raw_regions = _get(doc, "regions", "")
    if not isinstance(raw_regions, list):
        raise TransportError("RDMA descriptor: regions must be a list")
    regions = []
    for i, raw in enumerate(raw_regions):
        r = _obj(raw, f"regions[{i}]")
        w = f"regions[{i}]."
        regions.append(
            RegionInfo(
                name=_str(_get(r, "name", w), w + "name"),
                addr=_int(_get(r, "addr", w), w + "addr", 0, _U64),
                rkey=_int(_get(r, "rkey", w), w + "rkey", 0, _U32),
                length=_int(_get(r, "length", w), w + "length", 0, _U64),
            )
        )
    return RdmaDescriptor(
        version=_int(_get(doc, "version", ""), "version", 0, _U64),
        epoch=_int(_get(epoch, "value", "epoch."), "epoch.value", 0, _U64),
        epoch_addr=_int(_get(epoch, "addr", "epoch."), "epoch.addr", 1, _U64 - 7),
        epoch_rkey=_int(_get(epoch, "rkey", "epoch."), "epoch.rkey", 0, _U32),
        regions=tuple(regions),
        qp=QpInfo.from_json(_get(doc, "qp", "")),
    )


def encode_endpoint(info: QpInfo) -> bytes:
    """The reader's half of the handshake (its queue pair), as UTF-8 JSON."""
    return json.dumps({"format": FORMAT, "qp": info.to_json()}, separators=(",", ":")).encode()


def decode_endpoint(data: bytes) -> QpInfo:
    """Parse and validate `encode_endpoint`'s output; `TransportError` on anything else."""
    return QpInfo.from_json(_get(_load(data), "qp", ""))
