"""The reader side of same-host CUDA IPC (`transport.backend.ReaderBackend`).

A channel to one holder opens on its first read: connect to the holder's `ipc` endpoint,
send an `IpcRequest` with the read token, receive the `IpcGrant`, and prove eligibility:
the two fingerprints match (`transport.ipc.fingerprint`), the handles open
(`transport.ipc.cuda.open_grant`), and the probe chunk read through the mapping has the
wsum64 the holder computed over its own memory. Any of these failing is `IpcIneligible`:
the channel remembers why (its client's `Verdicts`), says so in `FetchStats.fallbacks`,
and reads the same holder over its TCP endpoint from then on. A refusal of the token (or NOT_HELD,
RELEASED...) is an outcome like over TCP; NOT_READY ("not over IPC here") is a fallback.

Each batch is then moved device to device: the chunks' segments joined into the fewest
spans (`transport.ipc.spans`), each one `copy_` on the channel's CUDA stream after the
holder's IPC event, the stream synchronized, every chunk verified against the manifest
where it now is (wsum64 on the GPU; an xxh3 version costs a copy to the host), and the
batch reported to the holder. Only when the holder's answer carries the epoch of the grant
are the chunks committed (`epoch_ok`, the RDMA seqlock's rule); otherwise the memory may
have changed under the copy and the whole batch is dropped (RELEASED). The bytes never go
through the host or a socket.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import socket
import time
from collections.abc import Iterator, Sequence
from typing import Any

from tensorhub.endpoints import format_endpoint
from tensorhub.errors import (
    IpcIneligible,
    TensorHubError,
    TransportError,
    VersionUnavailable,
)
from transport.backend import TransportKind
from transport.fetch_state import FetchState
from transport.frames import recv_message, send_message
from transport.ipc.cuda import (
    Mapping,
    copy_spans,
    mapped_wsum64,
    new_stream,
    open_grant,
)
from transport.ipc.fingerprint import Verdicts, local_fingerprint, mismatch
from transport.ipc.protocol import (
    MAX_GRANT_BYTES,
    MAX_SMALL_BYTES,
    Ack,
    IpcGrant,
    IpcRequest,
    Report,
    decode_reply,
)
from transport.ipc.spans import coalesce
from transport.outcome import ChunkOutcome, ChunkStatus
from transport.planner import Source
from transport.rdma.seqlock import epoch_ok
from transport.staging import StagingBuffer
from transport.tcp import TcpChannel
from transport.verification import DeviceBytes
from transport.wire import ErrorCode, Refusal

log = logging.getLogger(__name__)


class IpcChannel:
    """One lease on one holder's GPU memory, for one worker thread (module docstring)."""

    def __init__(
        self, f: FetchState, source: Source, staging: StagingBuffer | None, verdicts: Verdicts
    ) -> None:
        self._f, self._source, self._staging = f, source, staging
        self._verdicts = verdicts
        self._sock: socket.socket | None = None
        self._grant: IpcGrant | None = None
        self._mapping: Mapping | None = None
        self._stream: Any = None  # the channel's own torch.cuda.Stream, once open
        self._tcp: TcpChannel | None = None

    @property
    def endpoint(self) -> str:
        return format_endpoint(self._source.host, self._source.port)

    def read(self, chunks: Sequence[int]) -> Iterator[ChunkOutcome]:
        """One outcome per chunk in order; stops after the first that is not DONE."""
        if self._tcp is None:
            outcomes: list[ChunkOutcome] | None
            try:
                outcomes = self._read(chunks)
            except IpcIneligible as exc:
                outcomes = self._fall_back(str(exc), chunks[0])
            except (TensorHubError, OSError) as exc:
                outcomes = [ChunkOutcome.failed(chunks[0], exc)]
            if outcomes:
                yield from outcomes
                return
        assert self._tcp is not None
        yield from self._tcp.read(chunks)

    def _read(self, chunks: Sequence[int]) -> list[ChunkOutcome]:
        if self._grant is None:
            refused = self._open(chunks[0])
            if refused is not None:
                return [refused]
        return self._copy(chunks)

    def _open(self, index: int) -> ChunkOutcome | None:
        """Lease, map and probe; the refusal's outcome, or None when the mapping is proven."""
        f = self._f
        if not f.dest.on_cuda:
            raise IpcIneligible("the destination is in host memory")
        self._sock = f.connect(self._source)
        self._sock.settimeout(max(0.01, min(f.stall, f.deadline - time.monotonic())))
        me = local_fingerprint()
        request = IpcRequest(f.tenant, f.model, f.version, f.layout.digest, f.token(), me)
        send_message(self._sock, request.encode())
        reply = decode_reply(recv_message(self._sock, MAX_GRANT_BYTES))
        if isinstance(reply, Refusal):
            if reply.code is ErrorCode.NOT_READY:
                raise IpcIneligible(f"the holder says {reply.message}")
            return ChunkOutcome.refused(index, reply)
        if why := mismatch(me, reply.host):
            raise IpcIneligible(why)
        mapping = open_grant(reply, f.layout)
        probe, expected = reply.probe
        if probe >= f.layout.num_chunks:
            raise IpcIneligible(f"the grant's probe chunk {probe} is outside the layout")
        if mapped_wsum64(mapping, f.layout, probe) != expected:
            raise IpcIneligible(f"chunk {probe} read through the mapping is not the holder's")
        self._grant, self._mapping = reply, mapping
        self._stream = new_stream(f.dest.flats[0].device)
        return None

    def _copy(self, chunks: Sequence[int]) -> list[ChunkOutcome]:
        """Copy, verify, report, and commit `chunks` if the epoch held (module docstring)."""
        f, grant, mapping, stream = self._f, self._grant, self._mapping, self._stream
        assert grant is not None
        assert mapping is not None
        copy_spans(mapping.flats, f.dest.flats, coalesce(f.layout, chunks), stream, mapping.event)
        good: list[tuple[int, int | None]] = []
        bad: ChunkOutcome | None = None
        for index in chunks:  # checked where it now is (transport.verification)
            got = DeviceBytes(f.dest, index)
            error = f.verify.check(index, got, via="copied through CUDA IPC")
            if error is not None:
                bad = ChunkOutcome(index, ChunkStatus.CORRUPT, error)
                break
            good.append((index, got.known))
        assert self._sock is not None
        ack = _report(self._sock, len(chunks))
        if not epoch_ok(grant.epoch, ack.epoch, grant.epoch):
            self._f.discard(chunks)
            self._end_lease()
            why = f"{f.model}@{f.version} was released on {self._source.holder_id} during the copy"
            return [ChunkOutcome(chunks[0], ChunkStatus.RELEASED, VersionUnavailable(why))]
        out = []
        for index, checksum in good:
            f.dest.mark_present(index, checksum)
            out.append(
                ChunkOutcome(
                    index, ChunkStatus.DONE, nbytes=f.layout.payload_bytes(index), complete=True
                )
            )
        if bad is not None:
            self._f.discard([bad.index])
            out.append(bad)
        if ack.released:
            self._end_lease()  # the next batch asks again, and is refused RELEASED
        return out

    def _fall_back(self, why: str, index: int) -> list[ChunkOutcome] | None:
        """Read this holder over TCP from now on (None: the caller reads this batch so), or
        the failed outcome when it advertised no TCP endpoint."""
        f, source = self._f, self._source
        self._end_lease()
        self._verdicts.remember(self.endpoint, why)
        if source.tcp is None:
            error = TransportError(f"CUDA IPC with {source.holder_id} failed ({why}), no tcp")
            return [ChunkOutcome.failed(index, error)]
        log.info("reading holder %s over tcp: ipc: %s", source.holder_id, why)
        with f.lock:
            f.stats.transports[source.holder_id] = TransportKind.TCP.value
            f.stats.fallbacks[source.holder_id] = f"ipc: {why}"
        host, port = source.tcp
        tcp = dataclasses.replace(source, host=host, port=port, transport=TransportKind.TCP)
        self._tcp = TcpChannel(f, tcp, self._staging)
        return None

    def _end_lease(self) -> None:
        """Tell the holder this lease is over (best effort), then unmap."""
        sock, self._sock = self._sock, None
        if sock is not None:
            if self._grant is not None:
                with contextlib.suppress(TensorHubError, OSError):
                    _report(sock, 0, final=True)
            with self._f.lock:
                self._f.socks.discard(sock)
            with contextlib.suppress(OSError):
                sock.close()
        self._grant = self._mapping = self._stream = None

    def close(self) -> None:
        self._end_lease()
        if self._tcp is not None:
            self._tcp.close()


def _report(sock: socket.socket, copied: int, *, final: bool = False) -> Ack:
    """Report `copied` chunks done on the lease; the holder's answer (its epoch now)."""
    send_message(sock, Report(copied, final).encode())
    return Ack.decode(recv_message(sock, MAX_SMALL_BYTES))


class IpcTransport:
    """`ReaderBackend` over same-host CUDA IPC (docs/transport.md, "Same-host CUDA IPC").
    `verdicts`: where its channels remember the holders whose IPC failed (the client's)."""

    kind = TransportKind.IPC

    def __init__(self, verdicts: Verdicts) -> None:
        self.verdicts = verdicts

    def open(self, f: FetchState, source: Source, staging: StagingBuffer | None) -> IpcChannel:
        return IpcChannel(f, source, staging, self.verdicts)

    def close(self) -> None:
        """Nothing to free: each channel ends its own lease."""
