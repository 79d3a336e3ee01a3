"""Reliable-connected queue pairs: create one, and walk it RESET -> INIT -> RTR -> RTS.

The attributes follow rdma-core's own pyverbs tests (tests/base.py, ``RCResources``) and
``ibv_rc_pingpong``; the masks for each transition are the ones pyverbs' ``QP.to_init``,
``to_rtr`` and ``to_rts`` pass to ``ibv_modify_qp`` for RC.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from transport.rdma import _verbs
from transport.rdma.descriptor import QpInfo
from transport.rdma.device import RdmaDevice, mtu_enum

# Local ACK timeout 4.096 us * 2**14 = 67 ms, 7 retries: a dead peer fails a read in ~0.5 s,
# well inside any fetch deadline, instead of hanging it.
ACK_TIMEOUT = 14
RETRY_COUNT = 7
RNR_RETRY = 7
MIN_RNR_TIMER = 12


@dataclass
class RcQp:
    """A queue pair, its completion queue and the PSN it starts sending with."""

    qp: Any
    cq: Any
    psn: int
    depth: int

    def info(self, device: RdmaDevice) -> QpInfo:
        """What the peer needs to connect to this queue pair."""
        return QpInfo(
            qpn=int(self.qp.qp_num),
            psn=self.psn,
            lid=device.lid,
            gid=device.gid,
            port=device.port,
            mtu=device.mtu,
        )

    def close(self) -> None:
        """Destroy the queue pair, then its completion queue."""
        self.qp.close()
        self.cq.close()


def create_rc_qp(device: RdmaDevice, depth: int) -> RcQp:
    """An RC queue pair in RESET with a send queue of `depth` and its own completion queue."""
    v = device.verbs
    depth = max(1, min(depth, device.max_qp_wr))
    try:
        cq = v.cq.CQ(device.ctx, depth * 2, None, None, 0)
        cap = v.qp.QPCap(max_send_wr=depth, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
        init = v.qp.QPInitAttr(qp_type=v.enums.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap, sq_sig_all=1)
        qp = v.qp.QP(device.pd, init)
    except v.error as ex:
        raise _verbs.verbs_error("creating an RC queue pair", ex) from ex
    return RcQp(qp=qp, cq=cq, psn=random.getrandbits(24), depth=depth)


def connect_attr(
    v: _verbs.Verbs,
    *,
    port: int,
    gid_index: int,
    local_mtu: int,
    local_psn: int,
    remote: QpInfo,
    access: int,
    max_rd_atomic: int,
    max_dest_rd_atomic: int,
) -> Any:
    """The ``QPAttr`` for all three transitions of an RC queue pair towards `remote`.

    Needs no device (pyverbs builds the struct in memory), so it is tested everywhere.
    `access` is what the *peer* may do to memory through this queue pair: REMOTE_READ on
    the holder's side, nothing on the reader's.
    """
    attr = v.qp.QPAttr(port_num=port)
    attr.pkey_index = 0
    attr.qp_access_flags = access
    attr.path_mtu = min(mtu_enum(local_mtu), mtu_enum(remote.mtu))
    attr.dest_qp_num = remote.qpn
    attr.rq_psn = remote.psn  # we receive what the peer sends, starting at its PSN
    attr.sq_psn = local_psn
    attr.max_dest_rd_atomic = max_dest_rd_atomic
    attr.max_rd_atomic = max_rd_atomic
    attr.min_rnr_timer = MIN_RNR_TIMER
    attr.timeout = ACK_TIMEOUT
    attr.retry_cnt = RETRY_COUNT
    attr.rnr_retry = RNR_RETRY
    # Always route with a GRH: RoCE requires it, and InfiniBand accepts it within a subnet.
    route = v.addr.GlobalRoute(dgid=v.addr.GID(remote.gid), sgid_index=gid_index)
    attr.ah_attr = v.addr.AHAttr(port_num=port, is_global=1, gr=route, dlid=remote.lid)
    return attr


def connect(device: RdmaDevice, rc: RcQp, remote: QpInfo, access: int) -> None:
    """Move `rc` from RESET through INIT and RTR to RTS, connected to `remote`."""
    v = device.verbs
    attr = connect_attr(
        v,
        port=device.port,
        gid_index=device.gid_index,
        local_mtu=device.mtu,
        local_psn=rc.psn,
        remote=remote,
        access=access,
        max_rd_atomic=device.max_rd_atomic,
        max_dest_rd_atomic=device.max_dest_rd_atomic,
    )
    try:
        rc.qp.to_init(attr)
        rc.qp.to_rtr(attr)
        rc.qp.to_rts(attr)
    except v.error as ex:
        raise _verbs.verbs_error(f"connecting to remote QP {remote.qpn}", ex) from ex


def to_error(device: RdmaDevice, rc: RcQp) -> None:
    """Move the queue pair to ERR, which flushes every outstanding work request.

    After a deadline or a failed completion, reads may still be in flight; flushing them
    is what stops the device from writing into the destination later.
    """
    v = device.verbs
    try:
        attr = v.qp.QPAttr()
        attr.qp_state = v.enums.IBV_QPS_ERR
        rc.qp.modify(attr, v.enums.IBV_QP_STATE)
    except v.error:
        # Already in ERR or destroyed: nothing more can be flushed.
        return
