"""Is RDMA usable on this machine? One cached probe, which never raises.

"Usable" means more than "pyverbs imports": the kernel must list a device, the device must
open, and one of its ports must be ACTIVE. Each failure keeps its own reason, so that a
skipped test or a TCP fallback can say exactly why (torchstore's `*_available()` checks are
the model; their silent fallback is not).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from transport.rdma import _verbs


@dataclass(frozen=True)
class Probe:
    """What the probe found.

    Attributes:
        ok: an RDMA device with an active port can be used.
        reason: why not, when `ok` is false ('' otherwise).
        device: name of the first usable device ('' when none).
        port: its first ACTIVE port (0 when none).
    """

    ok: bool
    reason: str
    device: str = ""
    port: int = 0


@functools.cache
def probe() -> Probe:
    """Look for the first device with an ACTIVE port; cached for the process's lifetime."""
    missing = _verbs.import_error()
    if missing:
        return Probe(False, missing)
    v = _verbs.load()
    try:
        devices = v.device.get_device_list()
    except Exception as ex:  # PyverbsRDMAError when the kernel has no RDMA support
        return Probe(False, f"no RDMA device: {ex}")
    if not devices:
        return Probe(False, "no RDMA device: the kernel lists none")
    problems: list[str] = []
    for dev in devices:
        name = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
        try:
            ctx = v.device.Context(name=name)
        except Exception as ex:
            problems.append(f"{name}: cannot open ({ex})")
            continue
        try:
            ports = int(ctx.query_device().phys_port_cnt)
            for port in range(1, ports + 1):
                if ctx.query_port(port).state == v.enums.IBV_PORT_ACTIVE:
                    return Probe(True, "", name, port)
            problems.append(f"{name}: no ACTIVE port among {ports}")
        except Exception as ex:
            problems.append(f"{name}: query failed ({ex})")
        finally:
            ctx.close()
    return Probe(False, "no RDMA device with an active port: " + "; ".join(problems))


def rdma_available() -> bool:
    """True only if pyverbs imports and a device with an ACTIVE port opens. Never raises."""
    return probe().ok


def rdma_unavailable_reason() -> str:
    """Why `rdma_available()` is false, e.g. 'no RDMA device: Failed to get devices list'.

    Returns '' when RDMA is available.
    """
    return probe().reason
