"""One opened RDMA port: the verbs context, a protection domain and the port's addressing.

Both sides use it: the holder registers its tensors in its protection domain and creates
one queue pair per reader there; a reader registers its destination tensors and its own
queue pairs. Closing the device releases everything created from it.
"""

from __future__ import annotations

import errno
import threading
from typing import Any

from tensorhub.errors import TransportError
from transport.rdma import _verbs
from transport.rdma.availability import probe
from transport.rdma.descriptor import MTU_BYTES

_ZERO_GID = "0000:0000:0000:0000:0000:0000:0000:0000"
_IPV4_MAPPED = "0000:0000:0000:0000:0000:ffff:"
MAX_RD_ATOMIC = 16  # outstanding RDMA reads per queue pair; capped by the device below


def mtu_bytes(mtu_enum: int) -> int:
    """IBV_MTU_256..IBV_MTU_4096 (1..5) to bytes."""
    return 256 << (int(mtu_enum) - 1)


def mtu_enum(nbytes: int) -> int:
    """Bytes (256..4096) to IBV_MTU_* (1..5)."""
    return MTU_BYTES.index(nbytes) + 1


def _pick_gid_index(v: _verbs.Verbs, ctx: Any, port: int, pattr: Any) -> int:
    """InfiniBand: index 0. RoCE: a RoCE v2 GID, IPv4-mapped first (routable), else any non-zero."""
    if pattr.link_layer != v.enums.IBV_LINK_LAYER_ETHERNET:
        return 0
    roce_v2: int | None = None
    other: int | None = None
    for idx in range(int(pattr.gid_tbl_len)):
        try:
            gid = str(ctx.query_gid(port, idx).gid)
            gtype = ctx.query_gid_type(port, idx)
        except v.error:
            continue
        if gid == _ZERO_GID:
            continue
        if gtype == v.enums.IBV_GID_TYPE_SYSFS_ROCE_V2:
            if gid.startswith(_IPV4_MAPPED):
                return idx
            roce_v2 = idx if roce_v2 is None else roce_v2
        elif other is None:
            other = idx
    chosen = roce_v2 if roce_v2 is not None else other
    if chosen is None:
        raise TransportError(f"RDMA port {port} has no usable GID (is an IP address configured?)")
    return chosen


class RdmaDevice:
    """An opened device port with a protection domain.

    Args:
        name: device name (``mlx5_0``, ``rxe0``); default: the first with an ACTIVE port.
        port: physical port; default: the probe's ACTIVE port, or 1 with an explicit name.
        gid_index: GID table index; default: picked as in `_pick_gid_index`.

    Raises:
        TransportError: pyverbs is missing, the device does not open, or the port is not ACTIVE.
    """

    def __init__(
        self, name: str | None = None, port: int | None = None, gid_index: int | None = None
    ):
        v = _verbs.load()
        if name is None:
            found = probe()
            if not found.ok:
                raise TransportError(f"RDMA unavailable: {found.reason}")
            name, port = found.device, port or found.port
        port = port or 1
        self.verbs = v
        self.name = name
        self.port = port
        self._lock = threading.Lock()
        try:
            self.ctx: Any = v.device.Context(name=name)
        except v.error as ex:
            raise _verbs.verbs_error(f"opening device {name!r}", ex) from ex
        try:
            dattr = self.ctx.query_device()
            pattr = self.ctx.query_port(port)
            if pattr.state != v.enums.IBV_PORT_ACTIVE:
                raise TransportError(f"RDMA device {name!r} port {port} is not ACTIVE")
            self.gid_index = (
                _pick_gid_index(v, self.ctx, port, pattr) if gid_index is None else gid_index
            )
            self.gid = str(self.ctx.query_gid(port, self.gid_index).gid)
            self.lid = int(pattr.lid)
            self.mtu = mtu_bytes(pattr.active_mtu)
            self.max_msg_bytes = int(pattr.max_msg_sz)
            self.max_qp_wr = int(dattr.max_qp_wr)
            self.max_rd_atomic = max(1, min(MAX_RD_ATOMIC, int(dattr.max_qp_init_rd_atom)))
            self.max_dest_rd_atomic = max(1, min(MAX_RD_ATOMIC, int(dattr.max_qp_rd_atom)))
            self.pd: Any = v.pd.PD(self.ctx)
        except v.error as ex:
            self.ctx.close()
            raise _verbs.verbs_error(f"setting up device {name!r} port {port}", ex) from ex
        except TransportError:
            self.ctx.close()
            raise
        self.closed = False

    def register(self, address: int, length: int, access: int) -> Any:
        """Register `length` bytes at `address` (memory the caller owns and keeps alive).

        pyverbs' ``MR(pd, length, access, address=...)`` registers existing memory without
        copying and, on close, deregisters it without freeing it.
        """
        if address == 0 or length <= 0:
            raise TransportError("RDMA: cannot register an empty buffer")
        try:
            return self.verbs.mr.MR(self.pd, length, access, address=address)
        except self.verbs.error as ex:
            what = f"registering {length} bytes at {address:#x}"
            if getattr(ex, "error_code", None) == errno.ENOMEM:
                # Registration pins pages; the usual cause is RLIMIT_MEMLOCK, not real memory.
                what += " (raise the locked-memory limit: `ulimit -l unlimited` or CAP_IPC_LOCK)"
            raise _verbs.verbs_error(what, ex) from ex

    def allocate(self, length: int, access: int) -> Any:
        """Register a new page-aligned buffer that pyverbs owns (freed when the MR closes)."""
        try:
            return self.verbs.mr.MR(self.pd, length, access)
        except self.verbs.error as ex:
            raise _verbs.verbs_error(f"allocating a {length}-byte region", ex) from ex

    def close(self) -> None:
        """Close the context; pyverbs closes every PD, MR, CQ and QP made from it first."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            self.ctx.close()

    def __enter__(self) -> RdmaDevice:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
