"""Which holders a fetch's round reads from, and over which transport: the plan step of a
fetch (`ros.client.orchestrator`, its module docstring's step 2), and the sources of a read
of byte ranges (`ros.client.slice_ranges`).

It is kept apart from the orchestrator because it only chooses: from the holders a Resolve
named, this client's identity and its reader backends, it says which to read and how, and
why it passed a holder or a better transport over. It registers nothing, reads no byte and
keeps nothing between calls; the orchestrator runs the rounds, keeps their bookkeeping (the
suspects, the holders skipped, the slow ones already given their relaxed round) and asks
`SourcePlanner` for each round's sources.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from dataclasses import replace

from ros.client.identity import Identity
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from tensorhub.errors import InvalidArgument, SlowHolder, TensorHubError, VersionUnavailable
from transport.backend import TransportKind
from transport.outcome import final_error
from transport.planner import Candidate, Source, pipeline_sources, rank
from transport.selection import choose
from transport.topology import Topology
from transport.transports import ReaderBackends

# under the fetch's logger: a level set for `ros.client.orchestrator` covers the whole
# fetch, why its rounds passed a holder or a transport over included
log = logging.getLogger("ros.client.orchestrator.plan")

SLOW_ONLY_DIVISOR = 4
"""The rate floor of a round whose only holders were judged slow is the fetch's divided by
this (`SourcePlanner.slow_ones`): 64 KiB/s for the default floor."""


class SourcePlanner:
    """The sources of one client's rounds (module docstring). Thread-safe: it keeps only
    the client's identity and reader backends; every call's state is its arguments."""

    def __init__(self, me: Identity, readers: ReaderBackends) -> None:
        self._me = me
        self._readers = readers  # this client's reader backends (one per transport)

    def plan(
        self,
        holders: Sequence[pb.Holder],
        suspects: Collection[str],
        skipped: dict[str, str],
        *,
        device_memory: bool,
        fence: int | None,
    ) -> list[Source]:
        """The sources of the next round: the usable candidates less the suspects; the
        same-host CUDA IPC ones alone when there are any (a device-to-device copy costs the
        holder no NIC and next to no CPU, so colocated rollouts need not chain); else, for
        a holder (`fence`: its record's fence), through the pipeline policy (one
        predecessor); else (no holder: `fence` None, or no predecessor) all of them."""
        usable = [
            c
            for c in self.candidates(holders, skipped, device_memory=device_memory)
            if c.source.holder_id not in suspects
        ]
        local = [c.source for c in usable if c.source.transport is TransportKind.IPC]
        if local:
            return local
        if fence is not None:
            first = pipeline_sources(self._me.topology, fence, usable)
            if first:
                return first
        return [c.source for c in usable]

    def slow_ones(
        self,
        holders: Sequence[pb.Holder],
        suspects: dict[str, BaseException],
        relaxed: set[str],
        skipped: dict[str, str],
        *,
        device_memory: bool,
        fence: int | None,
    ) -> list[Source]:
        """The sources of a round when every usable holder is a suspect: those suspected
        only for being slower than the rate floor (`SlowHolder`), once each (added to
        `relaxed`), read under the floor divided by `SLOW_ONLY_DIVISOR`. The floor is there
        to move a reader off a trickler onto a holder that has the bytes; with no other
        holder left, failing the fetch helps nobody, while a link shared by many readers
        (16 connections on a 40 Mbit/s trainer link in `bench reshard`) can put an honest
        holder's connections under it. A trickler (far below the floor) is still caught."""
        slow = {
            holder
            for holder, why in suspects.items()
            if isinstance(why, SlowHolder) and holder not in relaxed
        }
        if not slow:
            return []
        others = {holder for holder in suspects if holder not in slow}
        planned = self.plan(holders, others, skipped, device_memory=device_memory, fence=fence)
        sources = [s for s in planned if s.holder_id in slow]
        relaxed.update(s.holder_id for s in sources)
        if sources:
            log.info(
                "only holders slower than the rate floor are left (%s): reading them at a "
                "floor %d times lower", ", ".join(s.holder_id for s in sources), SLOW_ONLY_DIVISOR,
            )  # fmt: skip
        return sources

    def candidates(
        self, holders: Sequence[pb.Holder], skipped: dict[str, str], *, device_memory: bool
    ) -> list[Candidate]:
        """The holders we can read from, each over the best transport both sides have (nixl
        → rdma → same-host CUDA IPC → tcp: `transport.selection`); why a better one was passed
        over is logged and travels in `Source.fallback` into `stats.fallbacks`. A holder
        whose endpoints we cannot use (written by an older hub, or naming only a transport
        we lack or did not enable; RDMA into device memory) is skipped, not fatal: it goes
        into `skipped` with the reason, logged once per fetch, and the others are read."""
        me = self._me.holder_name
        tls = self._me.tls is not None
        out = []
        for h in holders:
            if h.name == me:
                continue
            try:
                route = choose(
                    h.endpoints, complete=h.state == pb.COMPLETE, tls=tls,
                    device_memory=device_memory, verdicts=self._readers.verdicts,
                    local=self._readers.kinds,
                )  # fmt: skip
            except InvalidArgument as exc:
                if h.name not in skipped:
                    log.warning("skipping holder %s: %s", h.name, exc)
                skipped[h.name] = f"skipped: {exc}"
                continue
            if route.fallback:
                log.info("reading holder %s over %s: %s", h.name, route.kind.value, route.fallback)
            topology = Topology.of(h.topology)
            source = Source(
                h.name, route.host, route.port, topology,
                transport=route.kind, fallback=route.fallback, tcp=route.tcp,
            )  # fmt: skip
            out.append(Candidate(source, int(h.fence), h.state == pb.COMPLETE))
        return out

    def tcp_sources(self, holders: Sequence[pb.Holder]) -> list[Source]:
        """The sources of a read of byte ranges: `holders` over TCP (GET_RANGES is TCP's:
        one offered over another transport is asked at its TCP endpoint when it has one),
        nearest first."""
        out = []
        for c in self.candidates(holders, {}, device_memory=False):
            s = c.source
            if s.transport is not TransportKind.TCP:
                if s.tcp is None:
                    continue
                s = replace(s, host=s.tcp[0], port=s.tcp[1], transport=TransportKind.TCP)
            out.append(s)
        return rank(self._me.topology, out)


def nobody_left(
    what: str, suspects: dict[str, BaseException], skipped: dict[str, str]
) -> TensorHubError:
    """The error when no usable holder is left: the most telling of the suspects' reasons
    (bad bytes from all: `IntegrityError`), naming the holders skipped for their endpoints."""
    error = final_error(suspects, what) if suspects else VersionUnavailable(f"{what}: no holder")
    if skipped:
        why = "; ".join(f"{name}: {reason}" for name, reason in sorted(skipped.items()))
        error = type(error)(f"{error} (holders skipped: {why})")
    return error
