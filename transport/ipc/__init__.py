"""Same-host CUDA IPC: a reader maps a holder's GPU memory and copies it device to device.

Trainer and rollouts on one host (colocated RL, as checkpoint-engine and verl run it) need
not push weights through the host and a socket: the holder grants a lease on its memory
(`server`, under the read token), the reader proves the mapping (`fingerprint`, the grant's
probe), copies device to device on its own stream after the holder's IPC event, verifies,
and keeps the copy only if the version's epoch did not change meanwhile (`channel`). The
messages are in `protocol`, the CUDA calls in `cuda`, the copy plan in `spans`. Whenever
IPC is not possible the reader reads the holder over TCP and says why.
"""

from transport.ipc.availability import ipc_available, ipc_unavailable_reason

__all__ = ["ipc_available", "ipc_unavailable_reason"]
