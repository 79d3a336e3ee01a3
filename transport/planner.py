"""Chunk planning: which holder serves which chunk, and re-planning when one fails.

`plan` assigns chunks to the nearest tier of holders by topology (same host > rack > dc >
other dc), spreading bytes in proportion to each holder's spare capacity (`load` hint).
`ChunkScheduler` is the live, thread-safe form of a plan during one fetch: workers take
batches from their holder's queue, idle workers steal from holders at the same or a
greater distance, and a failed holder's unfinished chunks are re-planned onto the live
holders at once. Chunks already received are never planned again.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from transport.kinds import TransportKind
from transport.topology import Topology, distance

STOP_POLL = 0.05
"""How often a round's wait looks at its `stop` event (`ChunkScheduler.wait`)."""


@dataclass(frozen=True)
class Source:
    """A holder to read from. `load` is a hint (e.g. readers it serves now); higher means
    it gets proportionally fewer chunks. `transport` is the kind it is read over
    (host:port is that kind's endpoint), `fallback` why a better kind it offered was not
    used (`transport.selection`; '' when none was passed over), `tcp` its TCP endpoint
    when the transport may still fall back to it on opening (same-host IPC)."""

    holder_id: str
    host: str
    port: int
    topology: Topology = field(default_factory=Topology)
    load: int = 0
    transport: TransportKind = TransportKind.TCP
    fallback: str = ""
    tcp: tuple[str, int] | None = None  # its TCP endpoint, when `transport` may fall back


def rank(me: Topology, sources: Iterable[Source]) -> list[Source]:
    """Sources nearest first; ties broken by lower load, then holder id (deterministic)."""
    return sorted(sources, key=lambda s: (distance(me, s.topology), s.load, s.holder_id))


def nearest_tier(me: Topology, sources: Iterable[Source]) -> list[Source]:
    """The sources at the smallest topology distance from `me`."""
    ranked = rank(me, sources)
    if not ranked:
        return []
    best = distance(me, ranked[0].topology)
    return [s for s in ranked if distance(me, s.topology) == best]


def plan(
    chunks: Sequence[int], size: Callable[[int], int], sources: Sequence[Source], me: Topology
) -> dict[str, list[int]]:
    """Assign `chunks` (in order) to the nearest tier of `sources`, balancing bytes weighted
    by `1 + load`. Returns holder id -> ascending chunk list (every tier holder present)."""
    tier = nearest_tier(me, sources)
    out: dict[str, list[int]] = {s.holder_id: [] for s in tier}
    if not tier:
        return out
    assigned = dict.fromkeys(out, 0)
    weight = {s.holder_id: 1 + max(s.load, 0) for s in tier}
    order = [s.holder_id for s in tier]
    for index in chunks:
        n = size(index)
        best = min(order, key=lambda h: ((assigned[h] + n) * weight[h], order.index(h)))
        out[best].append(index)
        assigned[best] += n
    return out


class ChunkScheduler:
    """The shared state of one fetch's plan. All methods are thread-safe."""

    def __init__(
        self,
        chunks: Sequence[int],
        size: Callable[[int], int],
        sources: Sequence[Source],
        me: Topology,
    ) -> None:
        self._size, self._me = size, me
        self._sources = {s.holder_id: s for s in sources}
        self._live = set(self._sources)
        self._queues: dict[str, deque[int]] = {h: deque() for h in self._sources}
        for holder, assigned in plan(chunks, size, sources, me).items():
            self._queues[holder].extend(assigned)
        self._pending = set(chunks)  # not yet received
        self._cond = threading.Condition()
        self.failures: dict[str, BaseException] = {}

    @property
    def done(self) -> bool:
        return not self._pending

    def live(self) -> list[str]:
        with self._cond:
            return sorted(self._live)

    def queued(self, holder: str) -> list[int]:
        with self._cond:
            return list(self._queues[holder])

    def remaining(self) -> list[int]:
        with self._cond:
            return sorted(self._pending)

    def take(self, holder: str, max_chunks: int, timeout: float) -> list[int]:
        """Up to `max_chunks` chunks for `holder` to request next: its own queue first, else
        stolen from the back of the longest queue at the same or greater distance. Waits
        up to `timeout` s while other holders still have chunks in flight; [] means stop."""
        end = time.monotonic() + timeout
        with self._cond:
            while holder in self._live and self._pending:
                queue = self._queues[holder]
                if not queue:
                    self._steal(holder, max_chunks)
                if queue:
                    return [queue.popleft() for _ in range(min(max_chunks, len(queue)))]
                left = end - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            return []

    def _steal(self, holder: str, max_chunks: int) -> None:
        mine = distance(self._me, self._sources[holder].topology)
        victims = [
            h
            for h in self._live
            if h != holder
            and distance(self._me, self._sources[h].topology) >= mine
            and len(self._queues[h]) > 1
        ]
        if not victims:
            return
        victim = self._queues[max(victims, key=lambda h: len(self._queues[h]))]
        for _ in range(min(max_chunks, len(victim) // 2)):
            self._queues[holder].appendleft(victim.pop())

    def finished(self, index: int) -> None:
        """Chunk `index` was received and verified."""
        with self._cond:
            self._pending.discard(index)
            if not self._pending:
                self._cond.notify_all()

    def requeue(self, holder: str, chunks: Sequence[int]) -> None:
        """Give `chunks` back to `holder`'s queue (it is alive but lacked them for now)."""
        with self._cond:
            self._queues[holder].extendleft(reversed([c for c in chunks if c in self._pending]))
            self._cond.notify_all()

    def fail(self, holder: str, unfinished: Sequence[int], reason: BaseException) -> None:
        """Mark `holder` suspect for this fetch and re-plan its unfinished and queued chunks
        onto the live holders now."""
        with self._cond:
            self._live.discard(holder)
            self.failures.setdefault(holder, reason)
            orphans = sorted(
                {c for c in (*unfinished, *self._queues[holder]) if c in self._pending}
            )
            self._queues[holder].clear()
            live = [self._sources[h] for h in self._live]
            for h, assigned in plan(orphans, self._size, live, self._me).items():
                self._queues[h].extend(assigned)
            self._cond.notify_all()

    def wait(self, timeout: float, stop: threading.Event | None = None) -> bool:
        """Wait until every chunk arrived, no holder is live, or `stop` is set (looked at
        every `STOP_POLL` s); True if all arrived."""
        end = time.monotonic() + timeout
        with self._cond:
            while self._pending and self._live and not (stop is not None and stop.is_set()):
                left = end - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left if stop is None else min(left, STOP_POLL))
            return not self._pending

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()


@dataclass(frozen=True)
class Candidate:
    """A holder as a reader sees it when its fetch starts: where to read (`source`), when
    it registered (`fence`, its record's create revision: a total order) and its state."""

    source: Source
    fence: int
    complete: bool


def _groups(t: Topology) -> tuple[tuple[str, ...], ...]:
    """The keys under which a holder at `t` is found, nearest first (same host, rack, dc,
    anywhere): one key per `distance` tier."""
    return ((t.dc, t.rack, t.host), (t.dc, t.rack), (t.dc,), ())


def pipeline_plan(holders: Sequence[Candidate]) -> dict[str, Source]:
    """Pipelined replication for every PARTIAL reader in `holders`: the one holder each reads
    from, so that readers starting together neither split the publisher's uplink nor pile
    onto one peer's.

    Readers are taken in registration order (`fence`). Each reads from the holder that, in
    its nearest topology tier among the complete holders and the readers registered before
    it, feeds the fewest readers so far; ties go to complete holders (newest first, so the
    publisher is used last), then to the reader furthest along. The result is chains rooted
    at the complete holders, one reader per uplink, each a tier as local as possible: N
    readers finish in about one transfer time, and across datacenters only a dc's first
    reader reads over the WAN. Every reader computes the same plan from the same snapshot.
    """
    ordered = sorted(holders, key=lambda h: (not h.complete, h.fence, h.source.holder_id))
    groups: dict[tuple[str, ...], list[Candidate]] = {}
    children: dict[str, int] = {}

    def add(h: Candidate) -> None:
        children.setdefault(h.source.holder_id, 0)
        for key in _groups(h.source.topology):
            groups.setdefault(key, []).append(h)

    def rank_key(h: Candidate) -> tuple[int, int, int]:
        order = -h.fence if h.complete else h.fence
        return (children[h.source.holder_id], 0 if h.complete else 1, order)

    assignment: dict[str, Source] = {}
    for h in ordered:
        if h.complete:
            add(h)
            continue
        tier = next((groups[k] for k in _groups(h.source.topology) if groups.get(k)), [])
        if tier:
            source = min(tier, key=rank_key)
            children[source.source.holder_id] += 1
            assignment[h.source.holder_id] = source.source
        add(h)
    return assignment


def pipeline_sources(me: Topology, fence: int, holders: Sequence[Candidate]) -> list[Source]:
    """The one holder that a reader at `me`, registered at revision `fence`, reads from
    (see `pipeline_plan`); [] when there is no candidate (the caller then uses every holder).
    `holders` must not include the reader itself."""
    myself = Candidate(Source("\0self", "", 0, me), fence, False)
    before = [h for h in holders if h.complete or h.fence < fence]
    chosen = pipeline_plan([*before, myself]).get(myself.source.holder_id)
    return [] if chosen is None else [chosen]
