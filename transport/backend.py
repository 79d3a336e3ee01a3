"""Which data-plane transports this process can use, in preference order."""

from __future__ import annotations

import enum


class TransportKind(enum.Enum):
    RDMA = "rdma"
    IPC = "ipc"  # same-host CUDA IPC (transport.ipc)
    TCP = "tcp"


def available_transports() -> list[TransportKind]:
    """Usable transports, best first: RDMA (only if `transport.rdma.rdma_available()`),
    same-host CUDA IPC (only with a CUDA device: `transport.ipc.ipc_available()`), then
    TCP, which is always available. A missing or broken RDMA module is not an error."""
    kinds: list[TransportKind] = []
    try:
        from transport import rdma

        if rdma.rdma_available():
            kinds.append(TransportKind.RDMA)
    except ImportError:
        pass
    from transport.ipc.availability import ipc_available

    if ipc_available():
        kinds.append(TransportKind.IPC)
    kinds.append(TransportKind.TCP)
    return kinds
