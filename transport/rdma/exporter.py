"""Holder side: serve a held version's tensors to one-sided RDMA reads.

The holder registers each tensor's memory in place (no copy: pyverbs registers an existing
address) with REMOTE_READ, plus an 8-byte epoch word (see `seqlock`). For each reader it
creates one RC queue pair, connects it to the reader's, and answers with an
`RdmaDescriptor`. From then on the reader's NIC reads the holder's memory without the
holder's CPU; the holder only sees readers through the epoch word it bumps around every
overwrite, and through `revoke()`, which deregisters the memory so that every later read
fails at the NIC.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from tensorhub.errors import InvalidArgument, TransportError
from transport.rdma.descriptor import QpInfo, RdmaDescriptor, RegionInfo
from transport.rdma.device import RdmaDevice
from transport.rdma.qp import RcQp, connect, create_rc_qp
from transport.rdma.seqlock import EPOCH_BYTES, bump_epoch


def _check_tensor(name: str, tensor: torch.Tensor) -> None:
    if tensor.device.type != "cpu":
        raise InvalidArgument(f"RDMA export of {name!r}: only CPU tensors ({tensor.device})")
    if not tensor.is_contiguous():
        raise InvalidArgument(f"RDMA export of {name!r}: tensor is not contiguous")


class RdmaExporter:
    """Registers one held version for remote reads and manages its readers' queue pairs.

    Args:
        device: the opened port to serve on.
        tensors: name -> CPU contiguous tensor; the memory is registered where it is, so the
            tensors must stay allocated (the exporter keeps references) and must only be
            changed in place between `begin_overwrite()` and `end_overwrite()`.
        version: the version the tensors hold now.

    Thread-safe: the TCP server may call `accept` from several connections at once.
    """

    def __init__(self, device: RdmaDevice, tensors: Mapping[str, torch.Tensor], *, version: int):
        v = device.verbs
        self._device = device
        self._lock = threading.Lock()
        self._tensors = dict(tensors)
        self._version = version
        self._writing = False
        self._revoked = False
        self._closed = False
        self._epoch = 0
        self._peers: dict[int, RcQp] = {}
        self._mrs: dict[str, Any] = {}
        for name, tensor in self._tensors.items():
            _check_tensor(name, tensor)
        access = v.enums.IBV_ACCESS_REMOTE_READ
        try:
            for name, tensor in self._tensors.items():
                nbytes = tensor.numel() * tensor.element_size()
                if nbytes:
                    self._mrs[name] = device.register(tensor.data_ptr(), nbytes, access)
            self._epoch_mr: Any = device.allocate(
                EPOCH_BYTES, v.enums.IBV_ACCESS_LOCAL_WRITE | access
            )
        except TransportError:
            self._deregister()
            raise
        # One aligned 8-byte store per bump (pyverbs allocates the MR page-aligned).
        self._epoch_word = ctypes.c_uint64.from_address(int(self._epoch_mr.buf))
        self._epoch_word.value = self._epoch

    @property
    def epoch(self) -> int:
        """The current epoch word: even when the memory holds `version`, odd while writing."""
        return self._epoch

    def _set_epoch(self, value: int) -> None:
        self._epoch = value
        self._epoch_word.value = value

    @property
    def version(self) -> int:
        """The version the registered memory holds (when the epoch is even)."""
        return self._version

    def _regions(self) -> tuple[RegionInfo, ...]:
        regions = []
        for name, tensor in self._tensors.items():
            mr = self._mrs.get(name)
            nbytes = tensor.numel() * tensor.element_size()
            if mr is None:
                regions.append(RegionInfo(name=name, addr=0, rkey=0, length=0))
            else:
                regions.append(
                    RegionInfo(name=name, addr=int(mr.buf), rkey=int(mr.rkey), length=nbytes)
                )
        return tuple(regions)

    def accept(self, peer: QpInfo) -> RdmaDescriptor:
        """Connect a new queue pair to the reader's `peer` and describe the version to it.

        Raises:
            TransportError: the exporter is closed or revoked, an overwrite is in progress
                (readers must go elsewhere), or the queue pair cannot be connected.
        """
        with self._lock:
            if self._closed or self._revoked:
                raise TransportError("RDMA exporter is closed or revoked")
            if self._writing:
                raise TransportError(f"RDMA holder is overwriting version {self._version}")
            rc = create_rc_qp(self._device, depth=1)
            try:
                connect(self._device, rc, peer, self._device.verbs.enums.IBV_ACCESS_REMOTE_READ)
            except TransportError:
                rc.close()
                raise
            self._peers[int(rc.qp.qp_num)] = rc
            return RdmaDescriptor(
                version=self._version,
                epoch=self.epoch,
                epoch_addr=int(self._epoch_mr.buf),
                epoch_rkey=int(self._epoch_mr.rkey),
                regions=self._regions(),
                qp=rc.info(self._device),
            )

    def disconnect(self, qpn: int) -> None:
        """Destroy the queue pair serving one reader (its reads then fail at its NIC)."""
        with self._lock:
            rc = self._peers.pop(qpn, None)
        if rc is not None:
            rc.close()

    def begin_overwrite(self) -> None:
        """Mark the memory as being written: the epoch becomes odd; new `accept`s are refused.

        Call before changing any registered byte. A read that overlaps the write sees the
        odd or the changed epoch and discards its chunk (`TornRead`).
        """
        with self._lock:
            if self._writing:
                raise InvalidArgument("RDMA holder: begin_overwrite() twice")
            self._writing = True
            self._set_epoch(bump_epoch(self._epoch))

    def end_overwrite(self, version: int) -> None:
        """The memory now holds `version`: the epoch becomes the next even value."""
        with self._lock:
            if not self._writing:
                raise InvalidArgument("RDMA holder: end_overwrite() without begin_overwrite()")
            self._version = version
            self._set_epoch(bump_epoch(self._epoch))
            self._writing = False

    @contextlib.contextmanager
    def overwriting(self, version: int) -> Iterator[None]:
        """``with exporter.overwriting(v + 1): tensor.copy_(new)``; the epoch stays odd on error."""
        self.begin_overwrite()
        yield
        self.end_overwrite(version)

    def _deregister(self) -> None:
        mrs, self._mrs = self._mrs, {}
        for mr in mrs.values():
            mr.close()

    def revoke(self) -> None:
        """Deregister the tensors' memory: from now on every read fails at the reader's NIC.

        ``ibv_dereg_mr`` returns only once the device can no longer access the memory, so
        after `revoke()` the holder may free or reuse it without touching the epoch.
        """
        with self._lock:
            self._revoked = True
            self._deregister()

    def close(self) -> None:
        """Revoke the memory, destroy every reader's queue pair and free the epoch word."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._deregister()
            peers, self._peers = self._peers, {}
            for rc in peers.values():
                rc.close()
            self._epoch_mr.close()
