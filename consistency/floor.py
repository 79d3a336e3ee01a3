"""The revision floor: a client never accepts an answer older than what it has already seen.

Every answer from the hub carries the etcd revision it was read at. A client keeps the highest
one it has seen; an answer below it (for example from a hub replica that lags, or one that
came back from a partition) is rejected with `StaleRead`, and the caller retries elsewhere.
This is what makes a hub failover unable to move a client back in time (invariant 3).
"""

from __future__ import annotations

import threading

from tensorhub.errors import StaleRead

__all__ = ["RevisionFloor"]


class RevisionFloor:
    """Thread-safe high-water mark of observed etcd revisions."""

    def __init__(self, initial: int = 0) -> None:
        self._lock = threading.Lock()
        self._floor = initial

    @property
    def value(self) -> int:
        with self._lock:
            return self._floor

    def accept(self, revision: int, what: str = "answer") -> int:
        """Raise `StaleRead` if `revision` is below the floor; else raise the floor to it."""
        with self._lock:
            if revision < self._floor:
                raise StaleRead(
                    f"{what} at revision {revision} is older than revision {self._floor} "
                    "already seen by this client"
                )
            self._floor = revision
            return revision

    def observe(self, revision: int) -> None:
        """Raise the floor to `revision` if higher (for facts, such as our own writes)."""
        with self._lock:
            self._floor = max(self._floor, revision)
