"""One round of a fetch: read chunks of one version from a set of holders, straight into the
destination tensors.

`read_round` plans the wanted chunks that `dest` still misses across `sources` (nearest
first), then runs `parallel` worker connections, each over its holder's transport
(transport/transports.py). Each worker asks its holder for a batch of chunks (with the read
token its token source gives for that GET), receives every payload with recv_into directly
into the destination memory while hashing it, checks the CHUNK header (tenant, model,
version, index, offset, length) and the xxh3-64, and only then marks the chunk present
(transport/receiving.py) — from that moment `dest` serves it to other readers (when the
caller registered it in a store). Each chunk request ends in a typed `ChunkOutcome`; a
holder whose outcome is not DONE (a NOT_READY twice without progress, or anything else), or
that stays silent for `stall_timeout`, or sends a chunk it has below `rate_floor` bytes/s for
as long (transport/pace.py), is dropped for this round and its unfinished chunks re-planned
at once onto the others; only chunks not yet received are asked for again. A holder that
answers BUSY is full, not faulty: with a `busy` retry loop (the SDK's) the worker gives its
chunks back to the plan, waits the loop's backoff and asks it again, until the deadline.

A round never asks the control plane anything and never retries: it ends when every wanted
chunk is present, when no source is left, or at the deadline, and says which holders failed
and why (`Round`). Who else to ask, and whether to try again, is the SDK's fetch
orchestrator's decision (ros/client/orchestrator.py); what error a failed round ends with is
`Round.raise_unless_done`'s. `fetch` is one round and that check: a read from holders the
caller names, with no hub: the benchmarks of the data plane itself (`tensorhub bench
transport`, `bench failover`, `bench gpu`), and the transport's tests.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Protocol, TypedDict, Unpack

from tensorhub.errors import (
    DeadlineExceeded,
    HolderBusy,
    InvalidArgument,
    SlowHolder,
    TransportError,
    VersionUnavailable,
)
from tensorhub.names import validate_name, validate_version
from transport.backend import Channel
from transport.checks import STRICT, ChunkChecks
from transport.checksums import XXH3
from transport.fetch_state import BATCH_BYTES, FetchState, TokenSource
from transport.layout import Layout
from transport.outcome import ChunkOutcome, ChunkStatus, FetchStats, final_error
from transport.pace import DEFAULT_RATE_FLOOR
from transport.planner import ChunkScheduler, Source, rank
from transport.staging import StagingBuffer
from transport.store import HeldVersion
from transport.tls import TlsConfig
from transport.topology import Topology
from transport.transports import ReaderBackends

__all__ = [
    "BATCH_BYTES",
    "DEFAULT_RATE_FLOOR",
    "BusyRetry",
    "ChunkCallback",
    "FetchStats",
    "Round",
    "RoundOptions",
    "Source",
    "TokenSource",
    "fetch",
    "read_round",
]

DEFAULT_PARALLEL = 4
DEFAULT_STALL = 5.0

ChunkCallback = Callable[[int, int], None]
"""Told (chunk index, payload bytes) after each chunk is verified and committed, from the
worker thread that received it: the SDK's fetch progress. It must be quick and not raise."""


Pulled = ChunkOutcome | None
"""What one connection's worth of work ends with (`_pull`)."""


class BusyRetry(Protocol):
    """How a worker asks a holder that answered BUSY again: a retry loop that retries
    `HolderBusy` until `deadline` (a time.monotonic() value) or `stop()`, waiting with
    `sleep` between tries. The SDK passes `consistency.retry.RetryPolicy` (the client's
    one retry type: tries, full-jitter backoff, deadline), whose `retrying` fits; a loop
    that gives up re-raises the last `HolderBusy`, and the holder is then suspected."""

    def retrying(
        self,
        deadline: float | None,
        *,
        stop: Callable[[], bool] | None = None,
        sleep: Callable[[float], object] | None = None,
    ) -> Callable[[Callable[[], Pulled]], Pulled]: ...


@dataclass(frozen=True)
class Round:
    """How one round ended: the wanted chunks still missing (none: done), and each holder
    given up on in it, with why."""

    missing: list[int]
    failures: dict[str, BaseException]

    @property
    def done(self) -> bool:
        return not self.missing

    def raise_unless_done(self, what: str, deadline: float) -> None:
        """Nothing when every wanted chunk arrived; else the round's most telling error:
        `DeadlineExceeded` when `deadline` (time.monotonic()) has passed, else
        `final_error` of the holders given up on (`IntegrityError` when the only bytes on
        offer were bad, `PermissionDenied` when every holder refused the token,
        `VersionUnavailable` when no holder is left)."""
        if self.done:
            return
        if time.monotonic() >= deadline:
            raise DeadlineExceeded(
                f"{what}: deadline passed with {len(self.missing)} chunks missing"
            )
        raise final_error(self.failures, what)


def _pull(
    f: FetchState, sched: ChunkScheduler, source: Source, channel: Channel, batch: list[int]
) -> ChunkOutcome | None:
    """Ask `channel` for batches of `source`'s chunks until no work is left for it (None),
    or until a chunk's outcome is not DONE (that outcome). `batch` holds the chunks asked
    for and not yet received, for the caller to re-plan. The channel (any transport:
    transport.transports) connects on the first batch."""
    while True:
        batch[:] = sched.take(source.holder_id, f.batch, f.deadline - time.monotonic())
        if not batch or f.aborted:
            return None
        for out in channel.read(list(batch)):
            if out.status is not ChunkStatus.DONE:
                return out
            with f.lock:
                stats = f.stats
                stats.bytes_per_source[source.holder_id] = (
                    stats.bytes_per_source.get(source.holder_id, 0) + out.nbytes
                )
                stats.chunks += 1
                if out.index in stats.touched:
                    stats.refetched_bytes += out.nbytes
            sched.finished(batch.pop(0))
            if f.on_chunk is not None:
                f.on_chunk(out.index, out.nbytes)
        if batch:  # a channel that ended without an outcome for every chunk broke its contract
            return ChunkOutcome.failed(batch[0], TransportError("channel ended mid-batch"))


def _staging(f: FetchState) -> StagingBuffer | None:
    """A worker's host staging for a CUDA destination (None: received in place). Created in
    the caller's thread, after the destination was allocated: its copy streams wait on the
    caller's current streams (transport.copies.CudaCopies)."""
    if not f.dest.on_cuda:
        return None
    return StagingBuffer.for_tensors(f.layout.chunk_size, f.dest.tensors.values())


def _worker(
    f: FetchState,
    sched: ChunkScheduler,
    source: Source,
    staging: StagingBuffer | None,
    busy: BusyRetry | None,
    ended: threading.Event,
    readers: ReaderBackends,
) -> None:
    """One connection's worth of work against `source`, over its transport; reconnects
    after NOT_READY (a PARTIAL holder that lacks a chunk yet) and, under `busy`, after
    BUSY (the holder is full: its chunks go back to the plan, where other workers may take
    them, while this one backs off; `ended` cuts the backoff short when the round ends),
    and gives the holder up on any other outcome, on a second NOT_READY without progress
    in between, or on a BUSY that `busy` gives up on (or any BUSY without it)."""
    transport = readers.get(source.transport)
    strikes = 0
    batch: list[int] = []

    def attempt() -> Pulled:
        batch.clear()
        channel = transport.open(f, source, staging)
        try:
            out = _pull(f, sched, source, channel, batch)
        finally:
            channel.close()
        if busy is not None and out is not None and out.status is ChunkStatus.BUSY:
            sched.requeue(source.holder_id, batch)
            batch.clear()
            raise _busy_error(out)
        return out

    while not f.aborted:
        received = f.stats.bytes_per_source.get(source.holder_id, 0)
        try:
            if busy is None:
                out = attempt()
            else:
                loop = busy.retrying(f.deadline, stop=lambda: f.aborted, sleep=ended.wait)
                out = loop(attempt)
        except Exception as exc:  # still BUSY when the loop gave up, or a transport that
            sched.fail(source.holder_id, batch, exc)  # raised (it broke its contract)
            return
        if out is None:
            return
        progress = f.stats.bytes_per_source.get(source.holder_id, 0) != received
        strikes = 1 if progress else strikes + 1
        if out.status is ChunkStatus.NOT_READY and strikes < 2:
            sched.requeue(source.holder_id, batch)
            continue
        sched.fail(source.holder_id, batch, out.error or VersionUnavailable(out.status.value))
        return


def _busy_error(out: ChunkOutcome) -> HolderBusy:
    """The `HolderBusy` of a BUSY outcome (the refusal's own, else one naming the chunk)."""
    if isinstance(out.error, HolderBusy):
        return out.error
    return HolderBusy(f"holder busy at chunk {out.index}: {out.error}")


def _routed(stats: FetchStats, sources: Sequence[Source]) -> list[Source]:
    """`sources` as a list, each one's transport (and why not a better one) noted in `stats`."""
    for s in sources:
        stats.transports[s.holder_id] = s.transport.value
        if s.fallback:
            stats.fallbacks[s.holder_id] = s.fallback
    return list(sources)


def read_round(
    tenant: str,
    model: str,
    version: int,
    layout: Layout,
    dest: HeldVersion,
    sources: Sequence[Source],
    *,
    token: bytes | TokenSource,
    deadline: float,
    me: Topology,
    chunks: Collection[int] | None = None,
    parallel: int = DEFAULT_PARALLEL,
    stall_timeout: float = DEFAULT_STALL,
    expected: Sequence[int] | None = None,
    tls: TlsConfig | None = None,
    rate_floor: float = DEFAULT_RATE_FLOOR,
    checks: ChunkChecks = STRICT,
    stats: FetchStats | None = None,
    on_chunk: ChunkCallback | None = None,
    checksum: str = XXH3,
    busy: BusyRetry | None = None,
    readers: ReaderBackends | None = None,
    digests: Sequence[int] | None = None,
    stop: threading.Event | None = None,
) -> Round:
    """One round: read the chunks of `chunks` (default: every chunk) that `dest` misses, of
    tenant/model@version, from `sources`, before `deadline` (a time.monotonic() value), and
    say how it ended. Never raises for a holder's failure (that is in `Round.failures`, and
    in `stats.failed_sources`); never blocks past `deadline` (plus the time to cut its
    connections). `expected`, when given, is the publisher's xxh3 of every chunk (from the
    manifest): a chunk intact on the wire that differs from it is treated like a corrupt one.
    `tls` makes every connection mutual TLS. `rate_floor` (bytes/s, 0: off) suspects a holder
    that sends a chunk it has slower than that for `stall_timeout` (a trickler), as a silent
    one is suspected. `token` is the read token, or a callable asked for it before every GET
    (ros.client.read_token). `checks` are what each chunk must pass (`STRICT`; only chaos
    runs plant other ones). `stats` (a fresh `FetchStats` by default) is added to, so that
    the rounds of one fetch count into one; `on_chunk` sees every chunk committed.
    `checksum` is the algorithm of `expected` (the manifest's: `transport.checksums`).
    `busy` is how a holder that answers BUSY is asked again within `deadline` (the SDK's
    retry policy); None: a BUSY holder is suspected like any other failure. `readers` are
    the caller's reader backends (a client's own); None: the round builds its own and
    closes them when it ends. `digests`: under a linear `checksum` (wsum64), the xxh3-64 of
    every chunk that the manifest's delta section records (`result_xxh3`), checked too.
    `stop`, once set, ends the round as the deadline would (its connections cut, the
    chunks not yet in left missing, no holder blamed): a caller's read that failed
    elsewhere, or ended, takes back the request it had out."""
    validate_name(tenant, "tenant")
    validate_name(model, "model")
    validate_version(version)
    if dest.key != (tenant, model, version) or dest.layout.digest != layout.digest:
        raise InvalidArgument("dest does not hold this tenant/model/version/layout")
    if expected is not None and len(expected) != layout.num_chunks:
        raise InvalidArgument(f"{len(expected)} expected checksums for {layout.num_chunks} chunks")
    if digests is not None and len(digests) != layout.num_chunks:
        raise InvalidArgument(f"{len(digests)} chunk digests for {layout.num_chunks} chunks")
    if parallel < 1 or stall_timeout <= 0 or rate_floor < 0:
        raise InvalidArgument("parallel must be >= 1, stall_timeout > 0 and rate_floor >= 0")
    if chunks is not None and any(not 0 <= c < layout.num_chunks for c in chunks):
        raise InvalidArgument(f"a chunk asked for is outside 0..{layout.num_chunks - 1}")
    wanted = None if chunks is None else set(chunks)
    f = FetchState(
        tenant, model, version, dest, token, deadline, stall_timeout, expected, tls,
        rate_floor, checks, stats, on_chunk, checksum, digests,
    )  # fmt: skip
    missing = [c for c in dest.missing() if wanted is None or c in wanted]
    usable = _routed(f.stats, sources)
    if not missing or not usable:
        return Round(missing, {})
    own = readers is None
    backends = ReaderBackends() if readers is None else readers
    sched = ChunkScheduler(missing, layout.payload_bytes, usable, me)
    per_source = max(1, math.ceil(parallel / len(usable)))
    ended = threading.Event()  # set when the round ends: cuts any BUSY backoff short
    threads = [
        threading.Thread(
            target=_worker,
            args=(f, sched, s, _staging(f), busy, ended, backends),
            name=f"fetch-{s.holder_id}",
            daemon=True,
        )
        for s in rank(me, usable)
        for _ in range(per_source)
    ]
    for t in threads:
        t.start()
    try:
        sched.wait(deadline - time.monotonic(), stop)
    finally:
        f.abort()  # this round's state only: a late worker can start nothing new
        ended.set()
        sched.wake()
        for t in threads:
            t.join(timeout=max(0.1, stall_timeout))
        if own:
            backends.close()
    for holder, exc in sched.failures.items():
        f.stats.failed_sources[holder] = repr(exc)
        if isinstance(exc, SlowHolder):
            f.stats.slow_sources[holder] = exc.rate
    return Round([c for c in missing if not dest.is_present(c)], dict(sched.failures))


class RoundOptions(TypedDict, total=False):
    """The keyword options `fetch` passes through to `read_round` (see it for each one)."""

    chunks: Collection[int] | None
    parallel: int
    stall_timeout: float
    expected: Sequence[int] | None
    tls: TlsConfig | None
    rate_floor: float
    checks: ChunkChecks
    checksum: str
    busy: BusyRetry | None
    readers: ReaderBackends | None
    digests: Sequence[int] | None


def fetch(
    tenant: str,
    model: str,
    version: int,
    layout: Layout,
    dest: HeldVersion,
    sources: Sequence[Source],
    *,
    token: bytes | TokenSource,
    deadline: float,
    me: Topology,
    **options: Unpack[RoundOptions],
) -> FetchStats:
    """`read_round` from the holders named, raising when chunks are still missing after it:
    `IntegrityError` when the only bytes on offer were bad, `PermissionDenied` when every
    holder refused the token, `DeadlineExceeded` when time ran out, else `VersionUnavailable`
    (no holder left). Its stats, with the round's duration, when every chunk arrived.
    `options` are `read_round`'s, with its defaults."""
    start = time.monotonic()
    stats = FetchStats()
    result = read_round(
        tenant, model, version, layout, dest, sources, token=token, deadline=deadline, me=me,
        stats=stats, **options,
    )  # fmt: skip
    result.raise_unless_done(f"fetch {model}@{version}", deadline)
    stats.duration = time.monotonic() - start
    return stats
