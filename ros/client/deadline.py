"""One fetch's deadline, passed down to every call the fetch makes.

`fetch(timeout=T)` must return (or raise) within T, whatever the hub does: a hub that
stalls after the first Resolve must not turn the client's per-call default (10 s) into the
time each later call (RegisterHolder, UpdateHolder, the cleanup ReleaseHolder, Pin, Unpin)
may take. So a fetch makes one `Deadline` and every call inside it asks that object how
long it may take.

The last `reserve` seconds (10 % of T, at most 1 s) are kept back from the work (Resolve,
RegisterHolder, the data plane) for what follows it: marking the record COMPLETE, or, after
a failure, deleting the PARTIAL record and its pin. Cleanup that does not fit before the
deadline is skipped and logged; the record and the pin then go with the session's lease
(at `close()`, or when the lease expires if the client dies).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from tensorhub.errors import DeadlineExceeded, InvalidArgument

RESERVE_SHARE = 0.1  # the share of a fetch's timeout kept for completion or cleanup ...
RESERVE_MAX = 1.0  # ... but at most this many seconds
MIN_CALL = 0.05  # a call is not started with less time than this: it could not finish


@dataclass(frozen=True)
class Deadline:
    """When a call must have returned (`end`, a `time.monotonic()` value), and the last
    `reserve` seconds before it that the work leaves to completion and cleanup."""

    what: str
    end: float
    reserve: float

    @classmethod
    def after(cls, timeout: float, what: str) -> Deadline:
        """The deadline `timeout` seconds from now for the call described by `what`."""
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0:
            raise InvalidArgument(f"timeout must be a positive number of seconds, not {timeout!r}")
        reserve = min(RESERVE_MAX, RESERVE_SHARE * float(timeout))
        return cls(what, time.monotonic() + float(timeout), reserve)

    @property
    def work_end(self) -> float:
        """When the work (everything but completion and cleanup) must stop."""
        return self.end - self.reserve

    def left(self) -> float:
        """Seconds until `end`, 0 once it passed: the most a wait within this deadline may
        block."""
        return max(self.end - time.monotonic(), 0.0)

    def work(self, cap: float) -> float:
        """Seconds one call of the work may take: what is left before the reserve, at most
        `cap`. Raises `DeadlineExceeded` when too little is left to start one."""
        left = self.work_end - time.monotonic()
        if left < MIN_CALL:
            raise DeadlineExceeded(f"{self.what}: deadline passed")
        return min(left, cap)

    def part(self, share: float, what: str) -> Deadline:
        """The first `share` (0 < share <= 1) of the work time left, as a deadline of its
        own for one step of the call (`what`), with a reserve of its own for that step's
        completion or cleanup: a step that must leave the rest to the steps after it (a
        delta's companion leaves the other half to the rounds that read whole what the
        delta could not give). It ends within this deadline's work."""
        now = time.monotonic()
        span = max(0.0, self.work_end - now) * share
        reserve = min(RESERVE_MAX, RESERVE_SHARE * span)
        return Deadline(f"{self.what}: {what}", now + span, reserve)

    def finish(self, cap: float) -> float | None:
        """Seconds a completion or cleanup call may take: what is left before `end`, at most
        `cap`; None when too little is left to start one (the caller logs and skips it)."""
        left = self.end - time.monotonic()
        return None if left < MIN_CALL else min(left, cap)
