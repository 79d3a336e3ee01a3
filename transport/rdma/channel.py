"""The reader side of RDMA (`transport.backend.ReaderBackend`).

A channel to one holder is one `RdmaReader` (one RC queue pair) and the TCP control
connection it was set up over (`transport.rdma.control`). It opens on its first read:
connect the control channel, send the request with the reader's `QpInfo`, get the
holder's descriptor (or a refusal, turned into the chunk's typed outcome), connect the
queue pair. Each chunk is then read segment by segment straight into the destination
tensors (`RdmaReader.read`, seqlock-checked), hashed, checked against the publisher's
checksum and committed, exactly as a TCP chunk is. Nothing here imports pyverbs at
import time; without a device the first read's outcome is FAILED with the probe's reason
(the SDK never routes a holder to RDMA then: `transport.selection`). The opened port
belongs to the client's `RdmaTransport`, never to the module.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from tensorhub.errors import TensorHubError, TransportError
from transport.backend import TransportKind
from transport.fetch_state import FetchState
from transport.frames import recv_message
from transport.frames import send_message as send_control
from transport.outcome import ChunkOutcome, ChunkStatus
from transport.planner import Source
from transport.rdma.control import RdmaRequest, decode_reply, encode_request
from transport.rdma.descriptor import MAX_ENCODED_BYTES
from transport.staging import StagingBuffer
from transport.verification import HostBytes
from transport.wire import Refusal


class RdmaChannel:
    """One queue pair to one holder, for one worker thread."""

    def __init__(self, f: FetchState, source: Source, device: Callable[[], Any]) -> None:
        self._f, self._source, self._device = f, source, device
        self._sock: socket.socket | None = None
        self._reader: Any = None

    def _open(self, index: int) -> ChunkOutcome | None:
        """Connect and exchange descriptors; the refusal's outcome, or None when connected."""
        from transport.rdma.reader import RdmaReader

        f = self._f
        if f.dest.on_cuda:
            raise TransportError("RDMA reads into CPU tensors only")
        self._reader = RdmaReader(self._device())
        self._sock = f.connect(self._source)
        self._sock.settimeout(max(0.01, min(f.stall, f.deadline - time.monotonic())))
        request = RdmaRequest(
            f.tenant,
            f.model,
            f.version,
            f.layout.digest,
            f.token(),
            self._reader.endpoint(),
        )
        send_control(self._sock, encode_request(request))
        reply = decode_reply(recv_message(self._sock, MAX_ENCODED_BYTES))
        if isinstance(reply, Refusal):
            return ChunkOutcome.refused(index, reply)
        self._reader.connect(reply, version=f.version)
        return None

    def read(self, chunks: Sequence[int]) -> Iterator[ChunkOutcome]:
        """One outcome per chunk in order; stops after the first that is not DONE."""
        for index in chunks:
            try:
                if self._reader is None or self._reader.descriptor is None:
                    refused = self._open(index)
                    if refused is not None:
                        yield refused
                        return
                out = self._read_chunk(index)
            except (TensorHubError, OSError) as exc:
                out = ChunkOutcome.failed(index, exc)
            yield out
            if out.status is not ChunkStatus.DONE:
                return

    def _read_chunk(self, index: int) -> ChunkOutcome:
        f, reader = self._f, self._reader
        tensors = f.dest.tensors
        specs = f.layout.tensors
        timeout = max(0.01, min(f.stall, f.deadline - time.monotonic()))
        try:
            for seg in f.dest.segments(index):
                name = specs[seg.tensor].name
                buf = reader.register(tensors[name])
                reader.read(
                    name, buf, offset=seg.start, length=seg.length, dest_offset=seg.start,
                    timeout=timeout,
                )  # fmt: skip
        except TensorHubError:
            f.stats.touched.add(index)
            raise
        got = HostBytes(f.dest.sink_views(index))  # read in place: hashed where it landed
        bad = f.verify.check(index, got)
        if bad is not None:
            f.discard([index])
            return ChunkOutcome(index, ChunkStatus.CORRUPT, bad)
        nbytes = f.layout.payload_bytes(index)
        f.dest.commit(index, got.xxh3())
        return ChunkOutcome(index, ChunkStatus.DONE, nbytes=nbytes, complete=True)

    def close(self) -> None:
        """Close the control connection (the holder destroys our queue pair), then ours."""
        if self._sock is not None:
            with self._f.lock:
                self._f.socks.discard(self._sock)
            with contextlib.suppress(OSError):
                self._sock.close()
        if self._reader is not None:
            self._reader.close()


class RdmaTransport:
    """`ReaderBackend` over one-sided RDMA reads (docs/rdma.md). It owns the RDMA port its
    channels' queue pairs live in: opened by the first channel that connects (two
    workers never open it twice), closed with the client (`close`)."""

    kind = TransportKind.RDMA

    def __init__(self, opener: Callable[[], Any] | None = None) -> None:
        self._opener = opener
        self._lock = threading.Lock()
        self._device: Any = None

    def device(self) -> Any:
        """The opened port (`RdmaDevice`), opened on first use."""
        with self._lock:
            if self._device is None:
                from transport.rdma.device import RdmaDevice

                self._device = (self._opener or RdmaDevice)()
            return self._device

    def open(self, f: FetchState, source: Source, staging: StagingBuffer | None) -> RdmaChannel:
        return RdmaChannel(f, source, self.device)

    def close(self) -> None:
        with self._lock:
            device, self._device = self._device, None
        if device is not None:
            device.close()
