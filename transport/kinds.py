"""The names of the data-plane transports, in order of preference (a leaf: every layer of
`transport` may name a kind without importing the backend interface or any backend)."""

from __future__ import annotations

import enum

__all__ = ["TransportKind"]


class TransportKind(enum.Enum):
    NIXL = "nixl"  # NVIDIA's NIXL over UCX (transport.nixl): opt-in, `enabled_transports`
    RDMA = "rdma"
    IPC = "ipc"  # same-host CUDA IPC (transport.ipc)
    TCP = "tcp"
