"""A first reader of a block set asks for a step's trainer chunks before the step before it
has arrived (`ros.client.slice_read`, a reader in a layout reads each source shard in steps
of whole blocks: docs/design-notes.md, "Readers in another layout").

Each step of a source shard's pipeline is a read round of its own: a connection to the
trainer's holder and one GET. Run one after another, every step pays that GET's round trip
(and a connection's start) with the shard's link idle, and the first reader's requests to
the trainer queue behind the chunks it serves. So a pipeline starts step k+1 once step k
has `AHEAD_AT` of the chunks it asked for (`Step.landed`): at most one step ahead, and only
while the staging of the steps in flight of every pipeline stays within the read's budget
(`Window`, `slice_staging.STAGING_BUDGET`): a step that does not fit waits for the one
before it, as it would without this, and so does a step staged in GPU memory (one staging
copy there at a time).

What a step reads that the step in flight before it reads too (a trainer chunk both need),
it does not ask for: it waits for that step to end and takes the chunk from its carry
(`ros.client.slice_carry`), so no chunk is read twice (`Step.later`).

A failure of any step stops the read (`Stop`): every round still out is cut
(`Orchestrator.run(stop=...)`: its connections closed, its missing chunks left missing,
nothing of an unverified chunk copied out), and the read raises the first failure.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Collection

from ros.client.deadline import Deadline
from tensorhub.errors import DeadlineExceeded, TransportError

AHEAD_AT = 0.8
"""The share of the chunks a step asked for that have landed when the next step of its
source shard asks for its own (at the latest with one chunk left: `Step.landed`). Late in
the step, so that the two overlap about a round trip: run longer side by side, two
steps' connections to one trainer host share its link, the block set's chunks complete
out of order, and the readers chained behind (who ask for them in order) wait."""


class Stop:
    """One read's steps, stopped by the first failure of any: `event` ends every round
    still out; `error` is that first failure, the one the read raises."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.error: BaseException | None = None
        self._lock = threading.Lock()

    def fail(self, exc: BaseException) -> None:
        with self._lock:
            if self.error is None:
                self.error = exc
        self.event.set()

    def raise_first(self) -> None:
        """Raise the first failure, if any."""
        if self.error is not None:
            raise self.error


class Window:
    """The staging bytes of the steps in flight, across a read's pipelines. A pipeline's
    next step, once its step before has ended, always starts (`take`), as a read without
    steps ahead would; a step ahead starts only if it fits `budget` with the others
    (`try_take`)."""

    def __init__(self, budget: int) -> None:
        self._budget = budget
        self._used = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> None:
        with self._lock:
            self._used += nbytes

    def try_take(self, nbytes: int) -> bool:
        with self._lock:
            if self._used + nbytes > self._budget:
                return False
            self._used += nbytes
            return True

    def give(self, nbytes: int) -> None:
        with self._lock:
            self._used -= nbytes


class Step:
    """One step of one source shard's pipeline: the chunks of the shard it reads
    (`needed`), the step of the same shard still in flight when it started (`before`), and
    the signals between them. Thread-safe."""

    def __init__(self, needed: Collection[int], before: Step | None, stop: Stop) -> None:
        self.needed = frozenset(needed)
        self.before = before
        self.stop = stop
        self.ok = False
        self._go = threading.Event()  # the next step may ask for its chunks
        self._ended = threading.Event()
        self._lock = threading.Lock()
        self._asked = 0
        self._landed = 0
        self._last = False

    def asking(self, chunks: int, *, last: bool) -> None:
        """A round of this step asks for `chunks` chunks; `last`: its last staging group's.
        A last round that asks for none lets the next step go at once."""
        with self._lock:
            self._asked, self._landed, self._last = chunks, 0, last
            if last and chunks == 0:
                self._go.set()

    def landed(self, index: int) -> None:
        """A chunk this step asked for is verified and in its staging."""
        with self._lock:
            self._landed += 1
            due = max(1, min(self._asked - 1, math.ceil(AHEAD_AT * self._asked)))
            if self._last and self._landed >= due:
                self._go.set()

    def end(self, *, ok: bool) -> None:
        self.ok = ok
        self._ended.set()
        self._go.set()

    @property
    def ended(self) -> bool:
        return self._ended.is_set()

    def wait_go(self, deadline: Deadline) -> None:
        """Until the next step may start: `AHEAD_AT` of this step's last round landed, or
        the step ended; within `deadline`."""
        if not self._go.wait(timeout=deadline.left()):
            raise DeadlineExceeded(f"{deadline.what}: deadline passed within a step")

    def later(self, missing: Collection[int]) -> set[int]:
        """Of the chunks this step still `missing`, those the step before reads too: they
        are not asked for, but taken from its carry once it ended (`wait_before`)."""
        before = self.before
        if before is None:
            return set()
        return {i for i in missing if i in before.needed}

    def wait_before(self, deadline: Deadline) -> None:
        """Until the step before ended; raises when it failed (the read fails with its
        error: `Stop`) or the deadline passes."""
        before = self.before
        if before is None:
            return
        if not before._ended.wait(timeout=deadline.left()):
            raise DeadlineExceeded(f"{deadline.what}: deadline passed waiting for a step")
        if not before.ok:
            raise TransportError(f"{deadline.what}: the step before this one failed")
