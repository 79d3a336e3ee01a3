"""The one owner of a fetch on the SDK side: register → plan → rounds → failover → COMPLETE.

`Hub.fetch` (a whole version, or one shard in the publisher's layout: the reader becomes a
holder) and `Hub.fetch_slices` (the chunks of source shards that a block in another layout
needs: no holder) both resolve through `Orchestrator.resolve` and then hand a `Target` to
`Orchestrator.run`, which does the rest under one `RetryPolicy` (`FETCH_ROUNDS`) and the
fetch's one `Deadline`:

1. **register** (holders only): a PARTIAL record, which pins the version against retention
   and whose answer carries the candidates as seen from our fence (no second Resolve); the
   destination is in this client's holdings from here on, so it serves chunks as they land.
2. **plan** (`ros.client.fetch_plan`): the candidates we can read (`transport.selection`
   picks the transport per holder, and says why it passed a better one over), less the
   holders suspected so far, through the pipeline policy (`transport.planner.pipeline_sources`:
   one predecessor, so readers starting together form chains instead of all reading the
   publisher). A reader
   that is no holder, or one with no predecessor, reads from all of them (nearest tier).
3. **round**: `transport.reader.read_round` reads the wanted chunks still missing from
   exactly those sources, once, and says which holders failed and why. A holder that
   answers BUSY (its data port full of readers that presented tokens) is asked again
   within the round under `HOLDER_BUSY`, until the deadline, not suspected.
4. **failover**: a round that left chunks missing because holders failed or sent bad bytes
   (`VersionUnavailable`, `IntegrityError`) is followed, after the policy's backoff, by a
   Resolve without the manifest (who holds it now) and a fresh plan by the same policy, less
   every suspect (when only holders suspected for being slower than the rate floor are
   left, each gets one more round under a lower floor: `SourcePlanner.slow_ones`). The
   rounds end when the chunks are in, the policy's tries are spent, no usable holder is
   left, or the deadline passes.
5. **COMPLETE** (holders only): UpdateHolder marks our record complete (and drops the pin
   it held). A failure anywhere before that stops serving and deletes the PARTIAL record,
   within the deadline (the session's lease removes what does not fit).

The read token is renewed before it expires (`ros.client.read_token`), and every refresh's
token is offered to it too. Progress is reported per chunk committed (`Progress`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

from consistency.retry import RetryPolicy
from ros.client.deadline import Deadline
from ros.client.fetch_plan import SLOW_ONLY_DIVISOR, SourcePlanner, nobody_left
from ros.client.holdings import Holdings
from ros.client.hooks import RangeReader, RoundReader
from ros.client.identity import Identity
from ros.client.read_token import RenewingToken
from ros.client.reads import FreshReads
from ros.client.records import HolderRecords
from ros.client.serving import Serving
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from tensorhub.checksum_kinds import LINEAR
from tensorhub.errors import (
    DeadlineExceeded,
    HolderBusy,
    IntegrityError,
    InvalidArgument,
    TensorHubError,
    TransportError,
    VersionUnavailable,
)
from transport.outcome import FetchStats, final_error
from transport.pace import DEFAULT_RATE_FLOOR
from transport.planner import Source
from transport.ranged import read_ranges
from transport.reader import DEFAULT_PARALLEL
from transport.store import HeldVersion
from transport.transports import ReaderBackends

log = logging.getLogger(__name__)


def _another_round(exc: BaseException) -> bool:
    """A round is worth another, against a refreshed plan, when holders failed it (gone,
    cut, refused, too slow) or sent bad bytes; not after a refusal of the request itself."""
    return isinstance(exc, (VersionUnavailable, IntegrityError))


FETCH_ROUNDS = RetryPolicy(initial=0.05, maximum=1.0, tries=6, retry_on=_another_round)
"""The rounds of one fetch: up to 6, backing off 50 ms doubling to 1 s (full jitter),
within the fetch's deadline."""

HOLDER_BUSY = RetryPolicy(initial=0.05, maximum=1.0, retry_on=lambda e: isinstance(e, HolderBusy))
"""A holder that answered BUSY, asked again inside the round: backing off 50 ms doubling to
1 s (full jitter, so readers refused together do not return together), as often as the
fetch's deadline allows: a holder full for a moment does not fail a fetch with a long
deadline left."""


@dataclass(frozen=True)
class Progress:
    """How far a fetch is: chunks and payload bytes committed so far, of those it wants."""

    chunks: int
    total_chunks: int
    bytes: int
    total_bytes: int

    @property
    def fraction(self) -> float:
        return self.bytes / self.total_bytes if self.total_bytes else 1.0


ProgressCallback = Callable[[Progress], None]
"""Called after every chunk committed, from the thread that received it: keep it quick.
An exception it raises is logged, never propagated into the fetch."""

Landed = Callable[[int], None]
"""Called with each chunk's index once it is committed (verified, present), from the thread
that received it: how a delta applies the encoded chunks of its companion while the rest
of the companion is still on the wire. An exception it raises is logged, never propagated."""


@dataclass(frozen=True)
class Target:
    """What one run fills: `dest`, a reader's copy of model@version (of shard `shard`, None:
    the whole version) laid out as `manifest`; only the chunks in `chunks` (None: all). A
    `holder` target registers and serves what it has; a non-holder one (a staging copy of
    `fetch_slices`) is nobody's source and pins the version by other means."""

    model: str
    version: int
    shard: int | None
    dest: HeldVersion
    manifest: pb.Manifest
    chunks: Collection[int] | None = None
    holder: bool = True

    def wanted(self) -> list[int]:
        every = range(self.dest.layout.num_chunks)
        return list(every) if self.chunks is None else sorted(set(self.chunks))


def result_digests(manifest: pb.Manifest) -> list[int] | None:
    """The xxh3-64 of every chunk that the delta section of a version under a linear
    checksum (wsum64) records, which whole readers check as delta readers do (None when it
    records none: a version without a delta, or under xxh3-64, whose checksums are those)."""
    digests = manifest.delta.result_xxh3
    if manifest.checksum not in LINEAR or len(digests) != len(manifest.chunk_xxh3):
        return None
    return list(digests)


def manifest_of_shard(
    model: str, version: int, resolved: pb.ResolveResponse, shard: int | None
) -> pb.Manifest:
    """The manifest to read: the whole version's, or shard `shard`'s of a model-parallel one
    (a Resolve with `shard` answers only that shard's manifest, in `manifest`)."""
    count = resolved.shard_count or len(resolved.shards)
    if not count:
        if shard is not None:
            raise InvalidArgument(f"{model}@{version} is not model-parallel: omit shard")
        return resolved.manifest
    if shard is None:
        raise InvalidArgument(
            f"{model}@{version} is model-parallel ({count} shards): fetch one with shard=i "
            f"(0 <= i < {count}), or read blocks in another layout with fetch_slices"
        )
    if not 0 <= shard < count:
        raise InvalidArgument(f"shard {shard!r} out of range: {model}@{version} has {count}")
    manifest: pb.Manifest = resolved.shards[shard] if resolved.shards else resolved.manifest
    return manifest


def holder_shard(holder: pb.Holder) -> int | None:
    """The shard a holder of a model-parallel version holds (None: the whole version)."""
    return holder.shard if holder.HasField("shard") else None


def holders_of(response: pb.ResolveResponse, shard: int | None) -> list[pb.Holder]:
    """The holders that have these bytes: of shard `shard`, or of the whole version (None)."""
    return [h for h in response.holders if holder_shard(h) == shard]


class _Counter:
    """Chunks and bytes committed, counted from every worker thread, told to `progress`."""

    def __init__(
        self, target: Target, progress: ProgressCallback | None, landed: Landed | None = None
    ) -> None:
        wanted = target.wanted()
        layout = target.dest.layout
        self._total = Progress(0, len(wanted), 0, sum(layout.payload_bytes(c) for c in wanted))
        self._chunks = self._bytes = 0
        self._progress = progress
        self._landed = landed
        self._lock = threading.Lock()

    def __call__(self, index: int, nbytes: int) -> None:
        with self._lock:
            self._chunks += 1
            self._bytes += nbytes
            now = Progress(
                self._chunks, self._total.total_chunks, self._bytes, self._total.total_bytes
            )
        if self._landed is not None:
            try:
                self._landed(index)
            except Exception:
                log.exception("a fetch's chunk callback raised; the fetch goes on")
        if self._progress is not None:
            try:
                self._progress(now)
            except Exception:
                log.exception("a fetch's progress callback raised; the fetch goes on")


class Orchestrator:
    """Runs every fetch of one client (module docstring). Thread-safe: a run keeps its state
    on its own stack."""

    def __init__(
        self,
        me: Identity,
        reads: FreshReads,
        records: HolderRecords,
        holdings: Holdings,
        serving: Serving,
        read: RoundReader,
        readers: ReaderBackends,
        policy: RetryPolicy = FETCH_ROUNDS,
        busy: RetryPolicy = HOLDER_BUSY,
        ranges: RangeReader = read_ranges,
    ) -> None:
        self._me = me
        self.read_ranges = ranges  # byte ranges (`transport.ranged.read_ranges`, or a wrapper)
        self._reads = reads  # Resolve, fresh
        self._records = records  # our holder record: register, COMPLETE, delete
        self._holdings = holdings  # what this client serves
        self._serving = serving  # started before a record names its endpoints
        self._read = read  # one round (`transport.reader.read_round`, or a chaos wrapper)
        self._readers = readers  # this client's reader backends (one per transport)
        self._planner = SourcePlanner(me, readers)  # each round's sources
        self._policy = policy
        self._busy = busy

    def resolve(
        self,
        model: str,
        version: int,
        shard: int | None,
        deadline: Deadline,
        *,
        companion: bool = False,
    ) -> pb.ResolveResponse:
        """Resolve model@version (0: latest), with its manifest (of shard `shard`), and with
        `companion` its delta's companion too (`answer.companion`, when it has one)."""
        return self._reads.resolve(
            model, version, shard=shard, timeout=deadline.work(self._me.timeout),
            companion=companion,
        )  # fmt: skip

    def holders(
        self, model: str, version: int, shard: int | None, deadline: Deadline
    ) -> pb.ResolveResponse:
        """Who holds model@version (of shard `shard`) now, seen from our fence; no manifest."""
        return self._reads.resolve(
            model, version, shard=shard, fence=self._holdings.fence(model, version),
            manifest=False, timeout=deadline.work(self._me.timeout),
        )  # fmt: skip

    def run(
        self,
        target: Target,
        resolved: pb.ResolveResponse,
        deadline: Deadline,
        *,
        rate_floor: float = DEFAULT_RATE_FLOOR,
        progress: ProgressCallback | None = None,
        landed: Landed | None = None,
        stop: threading.Event | None = None,
        parallel: int = DEFAULT_PARALLEL,
    ) -> FetchStats:
        """Fill `target` from the holders `resolved` names (a Resolve of its version and
        shard), as the module docstring says; its stats, or the last round's named error.
        `landed` is told each chunk's index as it is committed. `stop`, once set, ends the
        run: the round in flight is cut (`transport.reader.read_round`), no other starts,
        and the run raises `TransportError` (a caller whose read failed elsewhere takes
        back what it asked for here). `parallel`: each round's connections (a caller that
        runs several at once gives each its share of `DEFAULT_PARALLEL`)."""
        if target.holder:
            self._serving.start()
            self._holdings.hold(target.dest, target.shard)
        start = time.monotonic()
        if target.holder and target.dest.complete:  # made whole from a delta: one call
            try:
                self._register_complete(target, deadline)
            except BaseException:
                self._abandon(target, deadline)
                raise
            return FetchStats(duration=time.monotonic() - start)
        try:
            counter = _Counter(target, progress, landed)
            stats = self._rounds(target, resolved, deadline, rate_floor, counter, stop, parallel)
            if target.holder:
                self._complete(target, deadline)
        except BaseException:
            if target.holder:
                self._abandon(target, deadline)
            raise
        stats.duration = time.monotonic() - start
        return stats

    # -- the steps ---------------------------------------------------------------------------

    def _rounds(
        self,
        target: Target,
        resolved: pb.ResolveResponse,
        deadline: Deadline,
        rate_floor: float,
        counter: _Counter,
        stop: threading.Event | None = None,
        parallel: int = DEFAULT_PARALLEL,
    ) -> FetchStats:
        me, dest = self._me, target.dest
        model, version, shard = target.model, target.version, target.shard
        what = f"fetch {model}@{version}" + ("" if shard is None else f" shard {shard}")
        fence, candidates = 0, holders_of(resolved, shard)
        if target.holder:
            registered = self._records.register(
                model, version, complete=False, shard=shard, timeout=deadline.work(me.timeout)
            )
            fence = int(registered.fence)
            self._holdings.registered(model, version, fence)
            candidates = list(registered.candidates) or candidates
        tokens = self._token(target, resolved, deadline)
        stats = FetchStats()
        suspects: dict[str, BaseException] = {}  # every holder given up on, in any round
        skipped: dict[str, str] = {}  # holders whose endpoints we cannot use: why
        relaxed: set[str] = set()  # slow holders given their round under a lower floor
        wanted = target.wanted()
        digests = result_digests(target.manifest)
        planner, cuda = self._planner, dest.on_cuda

        def stopped() -> bool:
            return stop is not None and stop.is_set()

        def one_round() -> None:
            nonlocal candidates
            if stopped():
                raise TransportError(f"{what}: stopped with {len(dest.missing())} chunks missing")
            if stats.rounds:  # failover: who holds it now, and a fresh plan by the same policy
                again = self.holders(model, version, shard, deadline)
                tokens.offer(bytes(again.read_token), int(again.token_expiry_unix))
                candidates = holders_of(again, shard)
            # a holder reads through the pipeline policy, under the fence a session
            # recovery may have changed since it registered
            ours = self._holdings.fence(model, version, fence) if target.holder else None
            sources = planner.plan(candidates, suspects, skipped, device_memory=cuda, fence=ours)
            floor = rate_floor
            if not sources:  # only the slow may be left: a slow read beats none
                sources = planner.slow_ones(
                    candidates, suspects, relaxed, skipped, device_memory=cuda, fence=ours
                )
                floor = rate_floor / SLOW_ONLY_DIVISOR
            if not sources:
                raise nobody_left(what, suspects, skipped)
            stats.rounds += 1
            result = self._read(
                me.tenant, model, version, dest.layout, dest, sources,
                token=tokens, deadline=deadline.work_end, me=me.topology, chunks=wanted,
                expected=list(target.manifest.chunk_xxh3), tls=me.tls, rate_floor=floor,
                stats=stats, on_chunk=counter, checksum=target.manifest.checksum,
                busy=self._busy, readers=self._readers, digests=digests, stop=stop,
                parallel=parallel,
            )  # fmt: skip
            suspects.update(result.failures)
            if result.done:
                return
            if stopped():
                raise TransportError(f"{what}: stopped with {len(result.missing)} chunks missing")
            if time.monotonic() >= deadline.work_end:
                raise DeadlineExceeded(
                    f"{what}: deadline passed with {len(result.missing)} chunks missing"
                )
            raise final_error(result.failures, what)

        retrying = (
            self._policy.retrying(deadline.work_end)
            if stop is None
            else self._policy.retrying(deadline.work_end, stop=stop.is_set, sleep=stop.wait)
        )
        retrying(one_round)
        for name, reason in skipped.items():
            stats.failed_sources.setdefault(name, reason)
        return stats

    def ranged_plan(
        self, target: Target, resolved: pb.ResolveResponse, deadline: Deadline
    ) -> tuple[list[Source], RenewingToken]:
        """What a read of byte ranges of `target` asks (`ros.client.slice_ranges`): the
        holders `resolved` names, over TCP (GET_RANGES is TCP's: one offered over another
        transport is asked at its TCP endpoint when it has one), nearest first, and the
        run's read token."""
        sources = self._planner.tcp_sources(holders_of(resolved, target.shard))
        return sources, self._token(target, resolved, deadline)

    def _token(
        self, target: Target, resolved: pb.ResolveResponse, deadline: Deadline
    ) -> RenewingToken:
        """The run's read token from `resolved`, renewed before it expires by a Resolve
        without the manifest, within the fetch's deadline (ros.client.read_token)."""

        def renew() -> tuple[bytes, int]:
            again = self.holders(target.model, target.version, target.shard, deadline)
            return bytes(again.read_token), int(again.token_expiry_unix)

        return RenewingToken(bytes(resolved.read_token), int(resolved.token_expiry_unix), renew)

    def _register_complete(self, target: Target, deadline: Deadline) -> None:
        """Register our record COMPLETE at once: every chunk is already in (applied from a
        delta and verified), so there is nothing to read and no PARTIAL step to serve."""
        registered = self._records.register(
            target.model, target.version, complete=True, shard=target.shard,
            timeout=deadline.work(self._me.timeout),
        )  # fmt: skip
        self._holdings.registered(target.model, target.version, int(registered.fence))

    def _complete(self, target: Target, deadline: Deadline) -> None:
        """Mark our record COMPLETE (under the fence a session recovery may have changed)."""
        fence = self._holdings.fence(target.model, target.version)
        budget = deadline.finish(self._me.timeout)
        if budget is None:
            raise DeadlineExceeded(
                f"{deadline.what}: every byte arrived, but no time was left to mark it COMPLETE"
            )
        self._records.complete(target.model, target.version, fence, target.shard, budget)

    def _abandon(self, target: Target, deadline: Deadline) -> None:
        """Undo a failed fetch within its deadline: stop serving, delete our PARTIAL record
        (and the pin it held). What does not fit in time is left to the session's lease."""
        model, version = target.model, target.version
        try:  # forgets its fence and shard too
            self._holdings.drop(target.dest.key, min(1.0, deadline.left()))
        except TensorHubError as exc:
            log.warning("abandoning %s@%d: %s", model, version, exc)
        budget = deadline.finish(self._me.timeout)
        try:  # deletes our record and the pin it held
            if budget is None:
                raise DeadlineExceeded("no time left before the fetch's deadline")
            self._records.release(model, version, force=True, timeout=budget)
        except TensorHubError as exc:  # the lease removes them anyway when we go
            log.warning(
                "cleanup of %s@%d not done (%s): our PARTIAL record and its pin are left to "
                "the session's lease (they go at close(), or when it expires)",
                model, version, exc,
            )  # fmt: skip
