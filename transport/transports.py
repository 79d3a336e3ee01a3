"""The `Transport` protocol: how a reader's worker talks to one holder, whatever the wire.

A transport opens a `Channel` to a holder (`Source`, whose host:port is that transport's
endpoint); a channel reads a set of chunks into the fetch's sink (`FetchState.dest`, a
PARTIAL `HeldVersion`, through `staging` for CUDA tensors) and gives back one typed
`ChunkOutcome` per chunk, in order, stopping after the first that is not DONE (done, not
ready, corrupt, denied, released, failed: `transport.outcome.ChunkStatus`). The reader
(`transport.reader`) plans, steals, fails over and counts on those outcomes alone, so it
runs unchanged over every transport:

- `TcpTransport` (here): GET frames over a socket, payloads received in place
  (`transport.receiving`);
- `RdmaTransport` (`transport.rdma.channel`): a descriptor over a TCP control channel,
  then one-sided reads;
- `IpcTransport` (`transport.ipc.channel`): a lease on a same-host holder's GPU memory,
  copied device to device (falling back to TCP, with the reason, when it cannot map).
"""

from __future__ import annotations

import socket
from collections.abc import Iterator, Sequence
from typing import Protocol

from tensorhub.errors import TensorHubError, TransportError
from transport.backend import TransportKind
from transport.netio import arm
from transport.outcome import ChunkOutcome, ChunkStatus
from transport.pace import Pace
from transport.planner import Source
from transport.receiving import FetchState, Settling
from transport.staging import StagingBuffer
from transport.wire import GetRequest, encode_get


class Channel(Protocol):
    """An open way to one holder, used by one worker thread at a time."""

    def read(self, chunks: Sequence[int]) -> Iterator[ChunkOutcome]:
        """Read `chunks` into the sink: one outcome each, in order, ending after the first
        that is not DONE. Never raises for the holder's faults (they are outcomes)."""
        ...

    def close(self) -> None:
        """Release the connection (idempotent)."""
        ...


class Transport(Protocol):
    """A kind of data plane a reader can read a holder over."""

    kind: TransportKind

    def open(self, f: FetchState, source: Source, staging: StagingBuffer | None) -> Channel:
        """A channel to `source` for fetch `f`; it connects on its first read."""
        ...


class TcpChannel:
    """GET frames over one TCP (or TLS) connection; the reader's original hot path."""

    def __init__(self, f: FetchState, source: Source, staging: StagingBuffer | None) -> None:
        self._f, self._source, self._staging = f, source, staging
        self._sock: socket.socket | None = None

    def read(self, chunks: Sequence[int]) -> Iterator[ChunkOutcome]:
        f = self._f
        index = chunks[0] if chunks else -1
        settling = Settling(self._staging)  # DONE once committed (staging: copy completed)
        try:
            if self._sock is None:
                self._sock = f.connect(self._source)
            sock = self._sock
            arm(sock, f.deadline, f.stall)
            wait_ms = int(f.stall * 500)  # a PARTIAL holder may wait stall/2 for a chunk
            request = GetRequest(
                f.tenant,
                f.model,
                f.version,
                f.layout.digest,
                f.token(),
                tuple(chunks),
                wait_ms,
            )
            sock.sendall(encode_get(request))
            # Once the holder says it has every chunk, the time between its frames is time
            # it withholds bytes it has too: one judge for the rest of the batch.
            pace: Pace | None = None
            for index in chunks:
                out = f.receive(sock, index, self._staging, pace)
                if out.status is not ChunkStatus.DONE:
                    yield from settling.flush()
                    yield out
                    return
                yield from settling.done(out)
                if out.complete and pace is None and (pace := f.pace(sock)) is not None:
                    pace.note(0)  # its window starts now
            yield from settling.flush()
        except (TensorHubError, OSError) as exc:
            yield from settling.flush()  # chunks already verified are committed first
            yield ChunkOutcome.failed(index, exc)

    def close(self) -> None:
        """Close the connection; copies still pending (a batch its reader abandoned) are
        completed and their chunks committed, unreported, so none outlives the channel."""
        try:
            if self._staging is not None:
                self._staging.flush()
        finally:
            if self._sock is not None:
                sock, self._sock = self._sock, None
                with self._f.lock:
                    self._f.socks.discard(sock)
                sock.close()


class TcpTransport:
    """`Transport` over the TCP data plane (docs/transport.md)."""

    kind = TransportKind.TCP

    def open(self, f: FetchState, source: Source, staging: StagingBuffer | None) -> TcpChannel:
        return TcpChannel(f, source, staging)


def transport_for(kind: TransportKind) -> Transport:
    """The transport of `kind` (RDMA's and IPC's modules are imported only when asked for)."""
    if kind is TransportKind.RDMA:
        from transport.rdma.channel import RdmaTransport

        return RdmaTransport()
    if kind is TransportKind.IPC:
        from transport.ipc.channel import IpcTransport

        return IpcTransport()
    if kind is TransportKind.TCP:
        return TcpTransport()
    raise TransportError(f"no transport of kind {kind!r}")
