"""A failpoint on a hub's etcd client, for tests that must hold one transaction at the door
(a batch that others queue behind, a write racing a delete) without timers."""

from __future__ import annotations

import threading
from typing import Any

from consistency import Etcd


class HeldTxn:
    """Failpoint on one hub's etcd client: the first transaction that puts a key starting
    with `prefix` waits at the door until `release()` (at most 30 s).

    It wraps `Etcd.txn` on the class, for the calls of `etcd` and of every view made from it
    (`Etcd.fenced` views share its members), so the held write is the real one, fence and
    all; other clients in the process pass through."""

    def __init__(self, etcd: Etcd, prefix: str) -> None:
        self._members = etcd._members
        self._prefix = prefix.encode()
        self.reached = threading.Event()
        self.leases: list[int] = []  # the leases the held transaction's puts name
        self.keys: list[str] = []  # the keys under `prefix` it puts
        self._open = threading.Event()
        self._original = Etcd.txn
        failpoint = self

        def txn(client: Etcd, compare: Any, success: Any, failure: Any = None, **kw: Any) -> Any:
            failpoint.stop_at(client, success)
            return failpoint._original(client, compare, success, failure, **kw)

        Etcd.txn = txn  # type: ignore[method-assign]

    def stop_at(self, client: Etcd, success: Any) -> None:
        if self.reached.is_set() or client._members is not self._members:
            return
        if self.matches(success):
            self.reached.set()
            self._open.wait(30)

    def matches(self, success: Any) -> bool:
        """Whether to hold the transaction whose success ops are `success`: one that puts a
        key under the prefix (noting its leases and keys)."""
        writes = [op.request_put.key for op in success if op.HasField("request_put")]
        if not any(k.startswith(self._prefix) for k in writes):
            return False
        self.leases = [op.request_put.lease for op in success if op.HasField("request_put")]
        self.keys = [k.decode() for k in writes if k.startswith(self._prefix)]
        return True

    def release(self) -> None:
        self._open.set()

    def remove(self) -> None:
        self.release()
        Etcd.txn = self._original  # type: ignore[method-assign]


class HeldDelete(HeldTxn):
    """`HeldTxn` for the first transaction that deletes the whole range under `prefix`
    (retention collecting one version, or a model's deletion: not a holder record's delete)."""

    def matches(self, success: Any) -> bool:
        ranges = [
            op.request_delete_range
            for op in success
            if op.HasField("request_delete_range") and op.request_delete_range.range_end
        ]
        return any(r.key == self._prefix for r in ranges)
