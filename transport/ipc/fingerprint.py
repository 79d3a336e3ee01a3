"""Whether two processes could share GPU memory through CUDA IPC, judged before any handle
is opened; and what this process remembers about holders whose IPC failed.

A holder's `host` topology label is self-declared, so eligibility is never read from it.
Both ends send a `HostFingerprint` instead, facts the kernel and the driver state:

- the boot id (`/proc/sys/kernel/random/boot_id`): a different one is another machine;
- the IPC namespace (`/proc/self/ns/ipc`): CUDA IPC handles do not open across IPC
  namespaces, the usual case of two containers started without a shared `--ipc`;
- the CUDA driver version: handles from one driver do not open under another;
- the process id: CUDA IPC maps another process's memory, never the process's own (two
  clients in one process read each other over TCP).

A match is necessary, not sufficient: the proof is that the handles open and that the
mapped bytes are the holder's (the grant's probe, `transport.ipc.channel`). A reader that
found a holder ineligible remembers why for `VERDICT_TTL` seconds, so its next fetches read
that holder over TCP at once (`transport.selection`) and say why.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

from tensorhub.errors import TransportError

VERDICT_TTL = 300.0
_MAX_FIELD = 256


def _read(path: str) -> str:
    try:
        with open(path, encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return ""


def _link(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""


def _driver() -> str:
    """The CUDA driver version torch sees ('' without CUDA)."""
    try:
        import torch

        if not torch.cuda.is_available():
            return ""
        driver: Any = getattr(torch._C, "_cuda_getDriverVersion")  # noqa: B009 (untyped)
        return str(driver())
    except (ImportError, AttributeError, RuntimeError):
        return ""


@dataclass(frozen=True)
class HostFingerprint:
    """The facts CUDA IPC between two processes depends on (module docstring)."""

    boot_id: str
    ipc_namespace: str
    driver: str
    pid: int = 0

    def to_json(self) -> dict[str, str | int]:
        return {
            "boot": self.boot_id, "ipc": self.ipc_namespace, "driver": self.driver,
            "pid": self.pid,
        }  # fmt: skip

    @classmethod
    def from_json(cls, value: Any) -> HostFingerprint:
        if not isinstance(value, dict):
            raise TransportError("IPC message: host must be an object")
        fields = [value.get(k) for k in ("boot", "ipc", "driver")]
        strings = [v for v in fields if isinstance(v, str) and len(v) <= _MAX_FIELD]
        pid = value.get("pid")
        if len(strings) != len(fields) or type(pid) is not int or not 0 <= pid < 1 << 32:
            raise TransportError("IPC message: host fields must be short strings and a pid")
        boot, ipc, driver = strings
        return cls(boot, ipc, driver, pid)


def local_fingerprint() -> HostFingerprint:
    """This process's fingerprint (its pid read anew: a forked child is another process)."""
    return dataclasses.replace(_host(), pid=os.getpid())


@functools.cache
def _host() -> HostFingerprint:
    return HostFingerprint(
        _read("/proc/sys/kernel/random/boot_id"), _link("/proc/self/ns/ipc"), _driver()
    )


def mismatch(mine: HostFingerprint, theirs: HostFingerprint) -> str:
    """Why `theirs` cannot share GPU memory with `mine` ('' when nothing rules it out)."""
    if not mine.boot_id or mine.boot_id != theirs.boot_id:
        return "the holder runs on another machine (boot ids differ)"
    if not mine.ipc_namespace or mine.ipc_namespace != theirs.ipc_namespace:
        return (
            "the holder is in another IPC namespace (containers without a shared --ipc): "
            f"{theirs.ipc_namespace or '?'} vs {mine.ipc_namespace or '?'}"
        )
    if not mine.driver or not theirs.driver:
        return "no CUDA driver in " + ("this process" if not mine.driver else "the holder")
    if mine.driver != theirs.driver:
        return f"the holder runs another CUDA driver ({theirs.driver} vs {mine.driver})"
    if mine.pid == theirs.pid:
        return "the holder is this process (CUDA IPC maps another process's memory)"
    return ""


class Verdicts:
    """Holders (by their `ipc` endpoint) whose IPC failed, with why, for `ttl` seconds."""

    def __init__(self, ttl: float = VERDICT_TTL) -> None:
        self._ttl = ttl
        self._lock = threading.Lock()
        self._why: dict[str, tuple[float, str]] = {}

    def remember(self, endpoint: str, why: str) -> None:
        with self._lock:
            self._why[endpoint] = (time.monotonic() + self._ttl, why)

    def known(self, endpoint: str) -> str:
        """Why IPC to `endpoint` failed within the last `ttl` seconds ('' if it did not)."""
        with self._lock:
            entry = self._why.get(endpoint)
            if entry is None:
                return ""
            if entry[0] < time.monotonic():
                del self._why[endpoint]
                return ""
            return entry[1]
