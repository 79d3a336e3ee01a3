"""The reader acts on the typed code of a holder's ERROR frame, never on its text (issue 13,
"not ready" is a status, not a string).

A real socket peer answers every GET with one ERROR frame of a chosen code and message and
counts the connections it got. NOT_READY makes the reader reconnect once (a PARTIAL holder
may have the chunk by then); any other code gives the holder up at once, whatever its
message says. Before, the reader matched "(NOT_READY)" in the error's text, so a BUSY
holder whose message contained it was asked again.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from tensorhub.errors import PermissionDenied, TransportError, VersionUnavailable
from tests.transport._model import MODEL, TENANT, make_model
from transport.layout import Layout
from transport.outcome import ChunkOutcome, ChunkStatus
from transport.reader import Source, fetch
from transport.store import HeldVersion
from transport.topology import Topology
from transport.wire import ErrorCode, FrameType, decode_error, encode_error, read_frame

EXPECTED = {
    ErrorCode.NOT_READY: ChunkStatus.NOT_READY,
    ErrorCode.DENIED: ChunkStatus.DENIED,
    ErrorCode.RELEASED: ChunkStatus.RELEASED,
    ErrorCode.NOT_HELD: ChunkStatus.RELEASED,
    ErrorCode.BUSY: ChunkStatus.BUSY,
    ErrorCode.BAD_FRAME: ChunkStatus.FAILED,
    ErrorCode.BAD_REQUEST: ChunkStatus.FAILED,
    ErrorCode.LAYOUT_MISMATCH: ChunkStatus.FAILED,
    ErrorCode.TOO_LARGE: ChunkStatus.FAILED,
    ErrorCode.UNSUPPORTED_VERSION: ChunkStatus.FAILED,
}


def _body(frame: bytes) -> bytearray:
    return bytearray(frame[12:])  # past the 12-byte header


def test_every_error_code_has_one_chunk_status() -> None:
    assert set(EXPECTED) == set(ErrorCode)
    for code, status in EXPECTED.items():
        refusal = decode_error(_body(encode_error(code, "(NOT_READY) whatever the text")))
        assert refusal.code is code
        out = ChunkOutcome.refused(3, refusal)
        assert (out.index, out.status) == (3, status)
        assert out.error is not None
    denied = ChunkOutcome.refused(0, decode_error(_body(encode_error(ErrorCode.DENIED, ""))))
    assert isinstance(denied.error, PermissionDenied)
    unknown = decode_error(_body(b"\0" * 12 + b"\x03\xe7\x00\x02hi"))  # code 999
    assert (unknown.code, unknown.raw) == (None, 999)
    assert ChunkOutcome.refused(0, unknown).status is ChunkStatus.FAILED
    assert isinstance(unknown.error(), TransportError)


class _Refuser:
    """A data port that answers each GET with one ERROR frame and closes."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        self.code, self.message = code, message
        self.connections = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @property
    def source(self) -> Source:
        host, port = self._listener.getsockname()[:2]
        return Source("refuser", host, port)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            self.connections += 1
            with conn:
                conn.settimeout(5)
                ftype, _ = read_frame(conn)
                assert ftype is FrameType.GET
                conn.sendall(encode_error(self.code, self.message))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._listener.close()


@pytest.fixture
def refuser() -> Iterator[list[_Refuser]]:
    made: list[_Refuser] = []
    yield made
    for r in made:
        r.close()


def _fetch_from(peer: _Refuser) -> None:
    tensors = make_model(1)
    layout = Layout.from_tensors(tensors, chunk_size=64 * 1024)
    dest = HeldVersion.reader(TENANT, MODEL, 1, layout, layout.allocate())
    fetch(
        TENANT, MODEL, 1, layout, dest, [peer.source], token=b"t",
        deadline=time.monotonic() + 20, me=Topology(), parallel=1, stall_timeout=2.0,
    )  # fmt: skip


def test_busy_whose_text_says_not_ready_is_not_retried(refuser: list[_Refuser]) -> None:
    peer = _Refuser(ErrorCode.BUSY, "chunk 0 not received yet (NOT_READY)")
    refuser.append(peer)
    with pytest.raises(VersionUnavailable, match="BUSY"):
        _fetch_from(peer)
    assert peer.connections == 1  # the old text match asked a second time


def test_not_ready_is_retried_once_whatever_its_text(refuser: list[_Refuser]) -> None:
    peer = _Refuser(ErrorCode.NOT_READY, "no such chunk here yet")
    refuser.append(peer)
    with pytest.raises(VersionUnavailable, match="NOT_READY"):
        _fetch_from(peer)
    assert peer.connections == 2  # asked again once, then given up: no progress between
