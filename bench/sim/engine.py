"""Flow-level network simulation: links with capacities, flows that share them max-min
fairly (progressive filling, vectorised with numpy), and pipelined flows that can never
overtake the flow feeding their source.

A flow moves `size` bytes from `src` to `dst` over a path of links (the source's uplink,
the destination's downlink, and the inter-dc link when it crosses). A flow read from a
PARTIAL holder has an `upstream` flow (the one filling that holder): it may start only
once one chunk has arrived upstream, and while it has caught up (is within a chunk of the
upstream's bytes) its rate is capped by the upstream's rate — the fluid form of a chunk
pipeline. `run` advances from event to event (a flow ends, a flow catches up, a scheduled
callback fires) and returns when no flow and no callback is left.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

EPS = 1e-9


@dataclass(eq=False)
class Flow:
    """`size` bytes over `links`; `done` is the simulated time it finished (None: not yet)."""

    links: tuple[int, ...]
    size: float
    latency: float = 0.0
    upstream: Flow | None = None
    lag: float = 0.0  # bytes the upstream must be ahead (one chunk)
    on_done: Callable[[Flow], None] | None = None
    sent: float = 0.0
    rate: float = 0.0
    start: float = 0.0
    done: float | None = None
    tag: str = ""
    dropped: bool = False

    def available(self) -> float:
        """Bytes this flow may have received by now (its upstream's progress bounds it)."""
        up = self.upstream
        if up is None or up.done is not None or up.dropped:
            return self.size
        return max(0.0, min(self.size, up.sent - self.lag))


@dataclass
class Network:
    """Links (capacities in bytes/s) and the flows on them, in simulated seconds."""

    capacity: list[float] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    now: float = 0.0
    flows: list[Flow] = field(default_factory=list)
    _timers: list[tuple[float, int, Callable[[], None]]] = field(default_factory=list)
    _seq: int = 0
    bytes_on: dict[int, float] = field(default_factory=dict)

    def link(self, name: str, bytes_per_s: float) -> int:
        self.capacity.append(bytes_per_s)
        self.names.append(name)
        return len(self.capacity) - 1

    def add(self, flow: Flow) -> Flow:
        flow.start = self.now + flow.latency
        self.flows.append(flow)
        return flow

    def at(self, when: float, fn: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self._timers, (when, self._seq, fn))

    def drop(self, flow: Flow) -> None:
        """Stop a flow (its source left); its bytes so far stay received."""
        flow.dropped = True
        flow.rate = 0.0
        if flow in self.flows:
            self.flows.remove(flow)

    def _rates(self, active: list[Flow]) -> None:
        """Max-min fair rates by progressive filling; pipelined flows that have caught up
        are capped by their upstream's rate. A cap depends on the upstream's rate from the
        pass before, so the passes repeat until no rate changes: a chain of depth d needs d
        passes (a fixed number of passes would leave the end of long chains at stale rates)."""
        n = len(active)
        capacity = np.array(self.capacity, dtype=float)
        incidence = np.zeros((len(capacity), n))
        for i, f in enumerate(active):
            incidence[list(f.links), i] = 1.0
        rate = np.zeros(n)
        for _ in range(n + 1):
            previous = np.array([f.rate for f in active])
            cap = np.full(n, np.inf)
            for i, f in enumerate(active):
                if f.upstream is not None and f.available() - f.sent <= EPS * max(f.size, 1):
                    cap[i] = f.upstream.rate if f.upstream in active else np.inf
            rate = np.zeros(n)
            frozen = cap <= EPS
            left = capacity.copy()
            while not frozen.all():
                free = ~frozen
                count = incidence[:, free].sum(axis=1)
                with np.errstate(divide="ignore", invalid="ignore"):
                    share = np.where(count > 0, left / count, np.inf)
                grow = min(float(share.min()), float((cap - rate)[free].min()))
                rate[free] += grow
                left -= count * grow
                full = (left <= EPS * capacity) & (count > 0)
                frozen |= incidence[full].any(axis=0) | (cap - rate <= EPS)
            for f, r in zip(active, rate, strict=True):
                f.rate = float(r)
            if np.allclose(rate, previous, rtol=1e-9, atol=EPS):
                break

    def run(self, until: float = float("inf")) -> float:
        """Advance until nothing is left to do (or `until`); returns the time."""
        while self.flows or self._timers:
            active = [f for f in self.flows if f.start <= self.now + EPS]
            if active:
                self._rates(active)
            step = float("inf")
            for f in self.flows:
                if f.start > self.now + EPS:
                    step = min(step, f.start - self.now)
                    continue
                if f.rate <= EPS:
                    continue
                gap = f.available() - f.sent
                if f.available() >= f.size:
                    step = min(step, (f.size - f.sent) / f.rate)
                elif gap > EPS * max(f.size, 1) and f.upstream is not None:
                    step = min(step, gap / max(f.rate - f.upstream.rate, EPS))
            if self._timers:
                step = min(step, self._timers[0][0] - self.now)
            if step == float("inf") or self.now + step > until:
                break
            step = max(step, 0.0)
            before = {id(f): f.sent for f in active}
            for f in active:
                f.sent = min(f.size, f.sent + f.rate * step)
            for f in active:  # a pipelined flow never passes its upstream (minus a chunk)
                f.sent = min(f.sent, max(f.available(), before[id(f)]))
                for link in f.links:
                    self.bytes_on[link] = self.bytes_on.get(link, 0.0) + f.sent - before[id(f)]
            self.now += step
            for f in [f for f in self.flows if f.size - f.sent <= EPS * max(f.size, 1)]:
                f.done = self.now
                self.flows.remove(f)
                if f.on_done is not None:
                    f.on_done(f)
            while self._timers and self._timers[0][0] <= self.now + EPS:
                heapq.heappop(self._timers)[2]()
        return self.now
