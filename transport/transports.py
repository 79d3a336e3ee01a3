"""The reader side of the backends (`transport.backend.ReaderBackend`), and one client's
set of them (`ReaderBackends`).

A reader backend opens a `Channel` to a holder (`Source`, whose host:port is that
transport's endpoint); a channel reads a set of chunks into the fetch's sink (`FetchState.dest`, a
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
  copied device to device (falling back to TCP, with the reason, when it cannot map);
- `NixlReader` (`transport.nixl.reader`): agent metadata over a TCP control channel, then
  one-sided NIXL READs into the destination.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator, Sequence

from tensorhub.errors import TensorHubError, TransportError
from transport.backend import ReaderBackend, TransportKind, enabled_transports
from transport.fetch_state import FetchState
from transport.netio import arm
from transport.outcome import ChunkOutcome, ChunkStatus
from transport.pace import Pace
from transport.planner import Source
from transport.receiving import Settling, pace_for, receive
from transport.staging import StagingBuffer
from transport.wire import GetRequest, encode_get


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
                out = receive(f, sock, index, self._staging, pace)
                if out.status is not ChunkStatus.DONE:
                    yield from settling.flush()
                    yield out
                    return
                yield from settling.done(out)
                if out.complete and pace is None and (pace := pace_for(f, sock)) is not None:
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
    """`ReaderBackend` over the TCP data plane (docs/transport.md)."""

    kind = TransportKind.TCP

    def open(self, f: FetchState, source: Source, staging: StagingBuffer | None) -> TcpChannel:
        return TcpChannel(f, source, staging)

    def close(self) -> None:
        """Nothing to free: each channel owns its connection."""


class ReaderBackends:
    """One client's reader backends, one per kind, each built when first asked for (RDMA's,
    IPC's and NIXL's modules are imported only then) and closed with the client (`close`).
    `kinds`: the transports this client reads over (`transport.backend.enabled_transports`;
    default: what this machine has, NIXL only when asked for). `verdicts`: the holders
    whose CUDA IPC failed lately, written by this client's IPC channels and read when it
    chooses a transport (`transport.selection`)."""

    def __init__(self, kinds: Sequence[TransportKind] | None = None) -> None:
        from transport.ipc.fingerprint import Verdicts

        self.kinds = tuple(enabled_transports() if kinds is None else kinds)
        self.verdicts = Verdicts()
        self._lock = threading.Lock()
        self._made: dict[TransportKind, ReaderBackend] = {}

    def get(self, kind: TransportKind) -> ReaderBackend:
        with self._lock:
            backend = self._made.get(kind)
            if backend is None:
                backend = self._made[kind] = self._make(kind)
            return backend

    def _make(self, kind: TransportKind) -> ReaderBackend:
        if kind is TransportKind.NIXL:
            from transport.nixl.reader import NixlReader

            return NixlReader()
        if kind is TransportKind.RDMA:
            from transport.rdma.channel import RdmaTransport

            return RdmaTransport()
        if kind is TransportKind.IPC:
            from transport.ipc.channel import IpcTransport

            return IpcTransport(self.verdicts)
        if kind is TransportKind.TCP:
            return TcpTransport()
        raise TransportError(f"no transport of kind {kind!r}")

    def close(self) -> None:
        with self._lock:
            made, self._made = list(self._made.values()), {}
        for backend in made:
            backend.close()
