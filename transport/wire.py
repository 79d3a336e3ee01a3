"""The TCP data-plane wire protocol: framed, versioned, bounded (docs/transport.md).

Every frame starts with a 12-byte header: magic `THUB`, wire version, frame type, flags
(zero) and body length. A reader sends GET (which chunks of which version, with its read
token); the holder answers one CHUNK per requested chunk — naming tenant, model, version,
chunk index and offset, with the xxh3-64 of the payload — then the payload bytes, or one
ERROR frame and closes. A reader that needs only parts of chunks sends GET_RANGES instead
(byte ranges within chunks, `ChunkRange`); the holder answers one CHUNK per range, whose
checksum is the xxh3-64 of that range's bytes. Anything malformed raises `TransportError`;
decoding never trusts a length it has not bounded first.
"""

from __future__ import annotations

import enum
import socket
import struct
from dataclasses import dataclass

from tensorhub.errors import (
    BadRange,
    HolderBusy,
    InvalidArgument,
    PermissionDenied,
    TensorHubError,
    TransportError,
    VersionUnavailable,
)
from tensorhub.names import validate_name, validate_version
from transport.netio import Meter, recv_views

MAGIC = b"THUB"
WIRE_VERSION = 1
HEADER = struct.Struct("!4sBBHI")  # magic, wire version, frame type, flags, body length
GET_FIXED = struct.Struct("!QQIH")  # version, layout digest, wait ms, number of chunks
CHUNK_FIXED = struct.Struct("!QIQQQ")  # version, chunk index, offset, payload length, xxh3
ERROR_FIXED = struct.Struct("!H")  # error code
MAX_BODY = 64 * 1024  # GET, CHUNK and ERROR bodies are small; payloads are bounded apart
MAX_CHUNKS_PER_GET = 4096
MAX_TOKEN = 4096
RANGE = struct.Struct("!III")  # chunk index, offset within the chunk, length
MAX_RANGES_PER_GET = 4096  # 48 KiB of ranges: the body stays under MAX_BODY with any token
FLAG_COMPLETE = 0x1  # on a CHUNK: the holder has every chunk of the version (rate floor)


class FrameType(enum.IntEnum):
    GET = 1
    CHUNK = 2
    ERROR = 3
    GET_RANGES = 4


class ErrorCode(enum.IntEnum):
    """Why a holder refused; each maps to one error class on the reader side."""

    BAD_FRAME = 1
    UNSUPPORTED_VERSION = 2
    TOO_LARGE = 3
    DENIED = 4
    NOT_HELD = 5
    RELEASED = 6
    LAYOUT_MISMATCH = 7
    NOT_READY = 8
    BUSY = 9
    BAD_REQUEST = 10


_ERROR_CLASS: dict[ErrorCode, type[TensorHubError]] = {
    ErrorCode.DENIED: PermissionDenied,
    ErrorCode.NOT_HELD: VersionUnavailable,
    ErrorCode.RELEASED: VersionUnavailable,
    ErrorCode.LAYOUT_MISMATCH: InvalidArgument,
    ErrorCode.BUSY: HolderBusy,
}


@dataclass(frozen=True)
class GetRequest:
    """Ask for `chunks` of tenant/model@version laid out as `layout_digest`; a PARTIAL
    holder may wait up to `wait_ms` for a chunk it does not have yet."""

    tenant: str
    model: str
    version: int
    layout_digest: int
    token: bytes
    chunks: tuple[int, ...]
    wait_ms: int


@dataclass(frozen=True)
class ChunkRange:
    """`length` bytes of chunk `chunk`, from `offset` within it (not in the flat space)."""

    chunk: int
    offset: int
    length: int


@dataclass(frozen=True)
class RangeRequest:
    """GET_RANGES: ask for `ranges` of tenant/model@version laid out as `layout_digest`, as
    GET asks for whole chunks (same token, same wait). The holder answers one CHUNK per
    range, in request order; whether each range lies inside its chunk only the holder's
    layout says (`check_ranges`)."""

    tenant: str
    model: str
    version: int
    layout_digest: int
    token: bytes
    ranges: tuple[ChunkRange, ...]
    wait_ms: int


def check_ranges(ranges: tuple[ChunkRange, ...] | list[ChunkRange]) -> None:
    """`BadRange` unless there are 1..`MAX_RANGES_PER_GET` ranges, each of at least one
    byte, and each fits the frame's u32 fields."""
    if not 0 < len(ranges) <= MAX_RANGES_PER_GET:
        raise BadRange(f"GET_RANGES must name 1..{MAX_RANGES_PER_GET} ranges, not {len(ranges)}")
    for r in ranges:
        if r.length <= 0:
            raise BadRange(f"range of chunk {r.chunk} at {r.offset} is empty")
        if not (0 <= r.chunk < 2**32 and r.offset >= 0 and r.offset + r.length <= 2**32):
            raise BadRange(f"range {r} does not fit a chunk's u32 fields")


@dataclass(frozen=True)
class ChunkHeader:
    """What a CHUNK frame says about the payload that follows it."""

    tenant: str
    model: str
    version: int
    index: int
    offset: int
    length: int
    checksum: int


def _pack_str(s: str) -> bytes:
    raw = s.encode()
    return struct.pack("!B", len(raw)) + raw


def _frame(ftype: FrameType, body: bytes, flags: int = 0) -> bytes:
    return HEADER.pack(MAGIC, WIRE_VERSION, ftype, flags, len(body)) + body


def _head_bytes(req: GetRequest | RangeRequest, n: int) -> bytes:
    """The fields GET and GET_RANGES begin with (`_request_head` reads them), for a request
    that lists `n` chunks or ranges."""
    return (
        GET_FIXED.pack(req.version, req.layout_digest, req.wait_ms, n)
        + _pack_str(req.tenant)
        + _pack_str(req.model)
        + struct.pack("!H", len(req.token))
        + req.token
    )


def encode_get(req: GetRequest) -> bytes:
    if not 0 < len(req.chunks) <= MAX_CHUNKS_PER_GET or len(req.token) > MAX_TOKEN:
        raise InvalidArgument("GET must name 1..4096 chunks and a token under 4 KiB")
    body = _head_bytes(req, len(req.chunks)) + struct.pack(f"!{len(req.chunks)}I", *req.chunks)
    return _frame(FrameType.GET, body)


def encode_get_ranges(req: RangeRequest) -> bytes:
    """A GET_RANGES frame; `BadRange` for too many ranges or an empty one."""
    check_ranges(req.ranges)
    if len(req.token) > MAX_TOKEN:
        raise InvalidArgument("GET_RANGES must carry a token under 4 KiB")
    body = _head_bytes(req, len(req.ranges)) + b"".join(
        RANGE.pack(r.chunk, r.offset, r.length) for r in req.ranges
    )
    return _frame(FrameType.GET_RANGES, body)


def encode_chunk_header(h: ChunkHeader, complete: bool = False) -> bytes:
    """A CHUNK frame (its payload follows); `complete`: this holder has the whole version,
    so a reader may judge its pace across frames too (`FLAG_COMPLETE`)."""
    body = (
        CHUNK_FIXED.pack(h.version, h.index, h.offset, h.length, h.checksum)
        + _pack_str(h.tenant)
        + _pack_str(h.model)
    )
    return _frame(FrameType.CHUNK, body, FLAG_COMPLETE if complete else 0)


def encode_error(code: ErrorCode, message: str) -> bytes:
    msg = message.encode()[:1024]
    return _frame(FrameType.ERROR, ERROR_FIXED.pack(code) + struct.pack("!H", len(msg)) + msg)


class _Cursor:
    """Bounds-checked reads from a received body; any overrun is a protocol error."""

    def __init__(self, body: bytes | bytearray) -> None:
        self._body, self._pos = memoryview(body), 0

    def take(self, n: int) -> memoryview:
        if self._pos + n > len(self._body):
            raise TransportError("truncated frame body")
        out = self._body[self._pos : self._pos + n]
        self._pos += n
        return out

    def unpack(self, st: struct.Struct) -> tuple[int, ...]:
        return tuple(st.unpack(self.take(st.size)))

    def string(self, kind: str) -> str:
        (n,) = struct.unpack("!B", self.take(1))
        try:
            return validate_name(bytes(self.take(n)).decode(), kind)
        except (UnicodeDecodeError, InvalidArgument) as exc:
            raise TransportError(f"bad {kind} in frame") from exc

    def done(self) -> None:
        if self._pos != len(self._body):
            raise TransportError("trailing bytes in frame body")


@dataclass(frozen=True)
class Rejection:
    """Why a frame header is unacceptable, and the code to answer it with."""

    code: ErrorCode
    message: str


def parse_header(raw: bytes | bytearray) -> tuple[FrameType, int] | Rejection:
    """Check a 12-byte header: magic, wire version, known type, bounded body length. Flags
    are advisory (`FLAG_COMPLETE`), so unknown ones are ignored, not refused."""
    magic, version, ftype, _flags, length = HEADER.unpack(raw)
    if magic != MAGIC:
        return Rejection(ErrorCode.BAD_FRAME, "bad magic: not a TensorHub data-plane frame")
    if version != WIRE_VERSION:
        return Rejection(ErrorCode.UNSUPPORTED_VERSION, f"wire version {version} unsupported")
    if length > MAX_BODY:
        return Rejection(ErrorCode.TOO_LARGE, f"frame body of {length} bytes exceeds {MAX_BODY}")
    if ftype not in FrameType._value2member_map_:
        return Rejection(ErrorCode.BAD_FRAME, f"unknown frame type {ftype}")
    return FrameType(ftype), length


def read_frame(sock: socket.socket) -> tuple[FrameType, bytearray]:
    """Read one frame (header, then its bounded body); malformed is `TransportError`."""
    ftype, _, body = read_flagged_frame(sock)
    return ftype, body


def read_flagged_frame(
    sock: socket.socket, meter: Meter | None = None
) -> tuple[FrameType, int, bytearray]:
    """`read_frame`, also returning the header's flags; `meter` (e.g. a rate floor's
    `Pace`) sees every piece as it arrives."""
    raw = bytearray(HEADER.size)
    recv_views(sock, [memoryview(raw)], meter=meter)
    parsed = parse_header(raw)
    if isinstance(parsed, Rejection):
        raise TransportError(f"peer sent a bad frame: {parsed.message}")
    ftype, length = parsed
    body = bytearray(length)
    recv_views(sock, [memoryview(body)], meter=meter)
    return ftype, int(HEADER.unpack(raw)[3]), body


def _request_head(cur: _Cursor) -> tuple[int, int, int, int, str, str, bytes]:
    """The fields GET and GET_RANGES begin with: version, layout digest, wait, the count
    of what they list, tenant, model and token."""
    version, digest, wait_ms, n = cur.unpack(GET_FIXED)
    tenant, model = cur.string("tenant"), cur.string("model")
    (tlen,) = struct.unpack("!H", cur.take(2))
    return version, digest, wait_ms, n, tenant, model, bytes(cur.take(tlen))


def decode_get(body: bytearray) -> GetRequest:
    try:
        cur = _Cursor(body)
        version, digest, wait_ms, n, tenant, model, token = _request_head(cur)
        if not 0 < n <= MAX_CHUNKS_PER_GET:
            raise TransportError(f"GET names {n} chunks")
        chunks = struct.unpack(f"!{n}I", cur.take(4 * n))
        cur.done()
        validate_version(version)
    except (TransportError, InvalidArgument, struct.error) as exc:
        raise TransportError(f"malformed GET: {exc}") from exc
    return GetRequest(tenant, model, version, digest, token, tuple(chunks), wait_ms)


def decode_get_ranges(body: bytearray) -> RangeRequest:
    """Decode a GET_RANGES body: `TransportError` when malformed, `BadRange` (a
    `InvalidArgument`) for too many ranges or an empty one."""
    try:
        cur = _Cursor(body)
        version, digest, wait_ms, n, tenant, model, token = _request_head(cur)
        if not 0 < n <= MAX_RANGES_PER_GET:
            raise BadRange(f"GET_RANGES names {n} ranges")
        ranges = tuple(ChunkRange(*cur.unpack(RANGE)) for _ in range(n))
        cur.done()
        check_ranges(ranges)
        validate_version(version)
    except BadRange:
        raise
    except (TransportError, InvalidArgument, struct.error) as exc:
        raise TransportError(f"malformed GET_RANGES: {exc}") from exc
    return RangeRequest(tenant, model, version, digest, token, ranges, wait_ms)


def decode_chunk_header(body: bytearray) -> ChunkHeader:
    cur = _Cursor(body)
    version, index, offset, length, checksum = cur.unpack(CHUNK_FIXED)
    tenant, model = cur.string("tenant"), cur.string("model")
    cur.done()
    return ChunkHeader(tenant, model, version, index, offset, length, checksum)


@dataclass(frozen=True)
class Refusal:
    """A holder's ERROR frame, decoded: `code` is None for a code this reader does not know
    (a newer holder), whose number is then in `raw`. Readers act on `code`, never on
    `message`, which is for people."""

    code: ErrorCode | None
    raw: int
    message: str

    def error(self) -> TensorHubError:
        """The named error this refusal maps to (`TransportError` for the other codes)."""
        if self.code is None:
            return TransportError(f"holder error {self.raw}: {self.message}")
        cls = _ERROR_CLASS.get(self.code, TransportError)
        return cls(f"holder refused ({self.code.name}): {self.message}")


def decode_error(body: bytearray) -> Refusal:
    """Decode an ERROR frame's body: its code (typed) and message."""
    cur = _Cursor(body)
    (raw,) = cur.unpack(ERROR_FIXED)
    (n,) = struct.unpack("!H", cur.take(2))
    message = bytes(cur.take(n)).decode(errors="replace")
    code = ErrorCode(raw) if raw in ErrorCode._value2member_map_ else None
    return Refusal(code, raw, message)
