"""Reader side: pull chunks of a holder's tensors with one-sided RDMA reads.

One `RdmaReader` is one RC connection to one holder. A chunk read is three steps, each
waited for before the next starts, so that the device cannot reorder them:

1. read the holder's epoch word; it must equal the descriptor's (even) epoch;
2. read the chunk straight into the destination tensor's registered memory, as a sliding
   window of RDMA READ work requests of at most `max_wr_bytes` each;
3. read the epoch again; it must still be the same.

A failed check raises `TornRead` (the planner fetches the chunk elsewhere); a failed
completion raises `TransportError`; running out of time raises `DeadlineExceeded`. After
either of the last two the queue pair is flushed (moved to ERR) and the reader is broken:
make a new one.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import torch

from tensorhub.errors import DeadlineExceeded, InvalidArgument, TornRead, TransportError
from transport.rdma import _verbs
from transport.rdma.descriptor import QpInfo, RdmaDescriptor
from transport.rdma.device import RdmaDevice
from transport.rdma.qp import RcQp, connect, create_rc_qp, to_error
from transport.rdma.seqlock import EPOCH_BYTES, epoch_ok

DEFAULT_TIMEOUT = 30.0
DEFAULT_MAX_WR_BYTES = 4 << 20
DEFAULT_QUEUE_DEPTH = 32
_SPIN_POLLS = 256  # empty polls before the poller starts sleeping between polls
_POLL_SLEEP = 50e-6


def plan_reads(length: int, max_wr_bytes: int) -> list[tuple[int, int]]:
    """Split `length` bytes into (offset, size) pieces of at most `max_wr_bytes` each."""
    if max_wr_bytes <= 0:
        raise InvalidArgument("max_wr_bytes must be positive")
    return [(off, min(max_wr_bytes, length - off)) for off in range(0, length, max_wr_bytes)]


@dataclass
class LocalBuffer:
    """Destination memory registered with LOCAL_WRITE, so that the NIC can write into it."""

    addr: int
    length: int
    lkey: int
    mr: Any
    owner: object  # the tensor, kept alive while registered


class RdmaReader:
    """An RC connection to one holder, for one thread at a time.

    Args:
        device: the local port to read through.
        queue_depth: RDMA READs in flight at once (send queue depth).
        max_wr_bytes: the largest single READ; capped by the port's max message size.
    """

    def __init__(
        self,
        device: RdmaDevice,
        *,
        queue_depth: int = DEFAULT_QUEUE_DEPTH,
        max_wr_bytes: int = DEFAULT_MAX_WR_BYTES,
    ):
        v = device.verbs
        self._device = device
        self._lock = threading.Lock()
        self._max_wr_bytes = max(1, min(max_wr_bytes, device.max_msg_bytes))
        self._rc: RcQp = create_rc_qp(device, queue_depth)
        self._epochs: Any = device.allocate(2 * EPOCH_BYTES, v.enums.IBV_ACCESS_LOCAL_WRITE)
        self._buffers: dict[tuple[int, int], LocalBuffer] = {}
        self._desc: RdmaDescriptor | None = None
        self._broken = ""
        self._next_wr_id = 0

    def endpoint(self) -> QpInfo:
        """This reader's queue pair, to send to the holder (`encode_endpoint`)."""
        return self._rc.info(self._device)

    @property
    def descriptor(self) -> RdmaDescriptor | None:
        """The holder's descriptor once connected."""
        return self._desc

    def connect(self, desc: RdmaDescriptor, *, version: int | None = None) -> None:
        """Connect to the holder queue pair named in `desc` (RESET -> INIT -> RTR -> RTS).

        With `version`, refuse a holder that serves another version (`TransportError`):
        a reader never accepts bytes of the wrong version.
        """
        if version is not None and desc.version != version:
            raise TransportError(f"RDMA holder serves version {desc.version}, not {version}")
        with self._lock:
            if self._desc is not None:
                raise InvalidArgument("RDMA reader is already connected")
            connect(self._device, self._rc, desc.qp, access=0)
            self._desc = desc

    def register(self, tensor: torch.Tensor) -> LocalBuffer:
        """Register a CPU contiguous destination tensor (cached by address and size)."""
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise InvalidArgument("RDMA destination must be a contiguous CPU tensor")
        nbytes = tensor.numel() * tensor.element_size()
        key = (tensor.data_ptr(), nbytes)
        with self._lock:
            buf = self._buffers.get(key)
            if buf is None:
                access = self._device.verbs.enums.IBV_ACCESS_LOCAL_WRITE
                mr = self._device.register(key[0], nbytes, access)
                buf = LocalBuffer(
                    addr=key[0], length=nbytes, lkey=int(mr.lkey), mr=mr, owner=tensor
                )
                self._buffers[key] = buf
            return buf

    def read(
        self,
        name: str,
        dest: LocalBuffer,
        *,
        offset: int = 0,
        length: int | None = None,
        dest_offset: int = 0,
        timeout: float = DEFAULT_TIMEOUT,
        on_data_posted: Callable[[], None] | None = None,
    ) -> None:
        """Read `length` bytes at `offset` of region `name` into `dest` at `dest_offset`.

        `on_data_posted` runs once the first data READs are posted and before any
        completes; it is the fault-injection point that the seqlock tests use.

        Raises:
            TornRead: the holder's epoch was odd, changed, or is not the descriptor's.
            TransportError: a READ completed with an error (e.g. the memory was revoked).
            DeadlineExceeded: `timeout` seconds passed first.
        """
        deadline = time.monotonic() + timeout
        desc = self._connected()
        region = desc.region(name)
        length = region.length - offset if length is None else length
        if offset < 0 or length < 0 or offset + length > region.length:
            raise InvalidArgument(f"RDMA read [{offset}, +{length}) is outside region {name!r}")
        if dest_offset < 0 or dest_offset + length > dest.length:
            raise InvalidArgument(f"RDMA read of {length} bytes does not fit the destination")
        with self._lock:
            if self._broken:
                raise TransportError(f"RDMA reader is unusable after: {self._broken}")
            before = self._read_epoch(desc, 0, deadline)
            if not epoch_ok(before, before, desc.epoch):
                raise TornRead(
                    f"RDMA holder epoch is {before}, not {desc.epoch}: version "
                    f"{desc.version} is being or was overwritten"
                )
            pieces = [
                (
                    dest.addr + dest_offset + off,
                    region.addr + offset + off,
                    size,
                    dest.lkey,
                    region.rkey,
                )
                for off, size in plan_reads(length, self._max_wr_bytes)
            ]
            self._run(pieces, deadline, on_data_posted)
            after = self._read_epoch(desc, 1, deadline)
            if not epoch_ok(before, after, desc.epoch):
                raise TornRead(
                    f"RDMA holder epoch moved {before} -> {after} during the read of "
                    f"{name!r} [{offset}, +{length}); chunk discarded"
                )

    def _connected(self) -> RdmaDescriptor:
        if self._desc is None:
            raise InvalidArgument("RDMA reader is not connected")
        return self._desc

    def _read_epoch(self, desc: RdmaDescriptor, slot: int, deadline: float) -> int:
        local = int(self._epochs.buf) + slot * EPOCH_BYTES
        piece = (local, desc.epoch_addr, EPOCH_BYTES, int(self._epochs.lkey), desc.epoch_rkey)
        self._run([piece], deadline, None)
        return int(ctypes.c_uint64.from_address(local).value)

    def _run(
        self,
        pieces: list[tuple[int, int, int, int, int]],
        deadline: float,
        on_posted: Callable[[], None] | None,
    ) -> None:
        """Post (local, remote, size, lkey, rkey) READs in a sliding window; wait for all."""
        v = self._device.verbs
        posted = done = 0
        empty_polls = 0
        while done < len(pieces):
            while posted < len(pieces) and posted - done < self._rc.depth:
                self._post(v, *pieces[posted])
                posted += 1
            if on_posted is not None:
                hook, on_posted = on_posted, None
                hook()
            n, wcs = self._poll(v, posted - done)
            for wc in wcs[:n]:
                if wc.status != v.enums.IBV_WC_SUCCESS:
                    self._fail(
                        f"RDMA READ completed with '{v.cq.cqe_status_to_str(wc.status)}' "
                        f"(status {wc.status}, vendor error {wc.vendor_err:#x})"
                    )
            done += n
            if n:
                empty_polls = 0
                continue
            if time.monotonic() > deadline:
                to_error(self._device, self._rc)
                self._broken = "deadline exceeded with RDMA READs in flight"
                raise DeadlineExceeded(f"RDMA read: {posted - done} READs still in flight")
            empty_polls += 1
            if empty_polls > _SPIN_POLLS:
                time.sleep(_POLL_SLEEP)

    def _post(
        self, v: _verbs.Verbs, local: int, remote: int, size: int, lkey: int, rkey: int
    ) -> None:
        sge = v.wr.SGE(local, size, lkey)
        wr = v.wr.SendWR(
            wr_id=self._next_wr_id,
            opcode=v.enums.IBV_WR_RDMA_READ,
            num_sge=1,
            sg=[sge],
            send_flags=v.enums.IBV_SEND_SIGNALED,
        )
        wr.set_wr_rdma(rkey, remote)
        self._next_wr_id += 1
        try:
            self._rc.qp.post_send(wr)
        except v.error as ex:
            self._fail(f"posting an RDMA READ failed: {ex}")

    def _poll(self, v: _verbs.Verbs, want: int) -> tuple[int, list[Any]]:
        try:
            n, wcs = self._rc.cq.poll(min(want, 16))
        except v.error as ex:
            self._fail(f"polling the completion queue failed: {ex}")
        return int(n), list(wcs)

    def _fail(self, why: str) -> NoReturn:
        to_error(self._device, self._rc)
        self._broken = why
        raise TransportError(why)

    def close(self) -> None:
        """Destroy the queue pair and deregister every destination buffer."""
        with self._lock:
            self._rc.close()
            buffers, self._buffers = self._buffers, {}
            for buf in buffers.values():
                buf.mr.close()
            self._epochs.close()
