"""Fetch one version from several holders straight into the destination tensors.

`fetch` plans the missing chunks of `dest` across `sources` (nearest first), then runs
`parallel` worker connections. Each worker asks its holder for a batch of chunks (with the
read token its token source gives for that GET), receives every payload with recv_into
directly into the destination memory while hashing it, checks the CHUNK header (tenant,
model, version, index, offset, length) and the xxh3-64, and only then marks the chunk
present (transport/receiving.py) — from that moment `dest` (registered in the local store
by the caller) serves it to other readers. Each chunk request ends in a typed
`ChunkOutcome`; a holder whose outcome is not DONE (a NOT_READY twice without progress, or
anything else), or that stays silent for `stall_timeout`, or sends a chunk it has below
`rate_floor` bytes/s for as long (transport/pace.py), is dropped for this fetch and its
unfinished chunks re-planned at once; only chunks not yet received are fetched again.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence

import tenacity

from tensorhub.errors import (
    DeadlineExceeded,
    IntegrityError,
    InvalidArgument,
    SlowHolder,
    TensorHubError,
    TransportError,
    VersionUnavailable,
)
from tensorhub.names import validate_name, validate_version
from transport.checks import STRICT, ChunkChecks
from transport.layout import Layout
from transport.outcome import ChunkOutcome, ChunkStatus, FetchStats, final_error
from transport.pace import DEFAULT_RATE_FLOOR
from transport.planner import ChunkScheduler, Source, rank
from transport.receiving import BATCH_BYTES, FetchState, TokenSource
from transport.staging import StagingBuffer
from transport.store import HeldVersion
from transport.tls import TlsConfig
from transport.topology import Topology
from transport.transports import Channel, transport_for

__all__ = ["BATCH_BYTES", "DEFAULT_RATE_FLOOR", "FetchStats", "Source", "TokenSource", "fetch"]

DEFAULT_PARALLEL = 4
DEFAULT_STALL = 5.0


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
                if out.index in f.touched:
                    stats.refetched_bytes += out.nbytes
            sched.finished(batch.pop(0))
        if batch:  # a channel that ended without an outcome for every chunk broke its contract
            return ChunkOutcome.failed(batch[0], TransportError("channel ended mid-batch"))


def _worker(f: FetchState, sched: ChunkScheduler, source: Source) -> None:
    """One connection's worth of work against `source`, over its transport; reconnects
    only after NOT_READY (a PARTIAL holder that lacks a chunk yet), and gives the holder
    up on any other outcome or on a second NOT_READY without progress in between."""
    staging = StagingBuffer(f.layout.chunk_size) if f.dest.on_cuda else None
    transport = transport_for(source.transport)
    strikes = 0
    while not f.aborted:
        batch: list[int] = []
        received = f.stats.bytes_per_source.get(source.holder_id, 0)
        channel = transport.open(f, source, staging)
        try:
            out = _pull(f, sched, source, channel, batch)
        finally:
            channel.close()
        if out is None:
            return
        progress = f.stats.bytes_per_source.get(source.holder_id, 0) != received
        strikes = 1 if progress else strikes + 1
        if out.status is ChunkStatus.NOT_READY and strikes < 2:
            sched.requeue(source.holder_id, batch)
            continue
        sched.fail(source.holder_id, batch, out.error or VersionUnavailable(out.status.value))
        return


def _routed(stats: FetchStats, sources: Sequence[Source]) -> list[Source]:
    """`sources` as a list, each one's transport (and why not a better one) noted in `stats`."""
    for s in sources:
        stats.transports[s.holder_id] = s.transport.value
        if s.fallback:
            stats.fallbacks[s.holder_id] = s.fallback
    return list(sources)


def _round(f: FetchState, sources: Sequence[Source], me: Topology, parallel: int) -> ChunkScheduler:
    """Fetch the missing chunks from `sources` until done, no source is left, or deadline."""
    missing = f.dest.missing()
    sched = ChunkScheduler(missing, f.layout.payload_bytes, sources, me)
    per_source = max(1, math.ceil(parallel / max(1, len(sources))))
    threads = [
        threading.Thread(
            target=_worker, args=(f, sched, s), name=f"fetch-{s.holder_id}", daemon=True
        )
        for s in rank(me, sources)
        for _ in range(per_source)
    ]
    f.aborted = False
    for t in threads:
        t.start()
    try:
        sched.wait(f.deadline - time.monotonic())
    finally:
        f.abort()
        sched.wake()
        for t in threads:
            t.join(timeout=max(0.1, f.stall))
    for holder, exc in sched.failures.items():
        f.stats.failed_sources[holder] = repr(exc)
        if isinstance(exc, SlowHolder):
            f.stats.slow_sources[holder] = exc.rate
    return sched


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
    refresh_sources: Callable[[], Sequence[Source]] | None = None,
    parallel: int = DEFAULT_PARALLEL,
    stall_timeout: float = DEFAULT_STALL,
    expected: Sequence[int] | None = None,
    tls: TlsConfig | None = None,
    rate_floor: float = DEFAULT_RATE_FLOOR,
    checks: ChunkChecks = STRICT,
) -> FetchStats:
    """Fill `dest`'s missing chunks of tenant/model@version from `sources` before
    `deadline` (a time.monotonic() value). Raises `VersionUnavailable` when no holder is
    left, `IntegrityError` when the only bytes on offer were bad, `DeadlineExceeded` when
    time ran out; never blocks past `deadline`. `expected`, when given, is the publisher's
    xxh3 of every chunk (from the manifest): a chunk that is intact on the wire but differs
    from it is treated like a corrupt one and fetched elsewhere. `tls` makes every
    connection mutual TLS (holders must serve TLS with a certificate from the same CA).
    `rate_floor` (bytes/s, 0: off) suspects a holder that sends a chunk it has slower than
    that for `stall_timeout` (a trickler), as a silent one is suspected. `token` is the
    read token, or a callable asked for it before every GET (so a fetch longer than one
    token's life renews it: ros.client.read_token). `checks` are what each chunk must pass
    (`STRICT`; only chaos runs plant other ones)."""
    validate_name(tenant, "tenant")
    validate_name(model, "model")
    validate_version(version)
    if dest.key != (tenant, model, version) or dest.layout.digest != layout.digest:
        raise InvalidArgument("dest does not hold this tenant/model/version/layout")
    if expected is not None and len(expected) != layout.num_chunks:
        raise InvalidArgument(f"{len(expected)} expected checksums for {layout.num_chunks} chunks")
    if parallel < 1 or stall_timeout <= 0 or rate_floor < 0:
        raise InvalidArgument("parallel must be >= 1, stall_timeout > 0 and rate_floor >= 0")
    start = time.monotonic()
    what = f"fetch {model}@{version}"
    f = FetchState(
        tenant, model, version, dest, token, deadline, stall_timeout, expected, tls,
        rate_floor, checks,
    )  # fmt: skip
    suspects: set[str] = set()
    current = _routed(f.stats, sources)
    # A round that ends with holders unreachable (VersionUnavailable) or with bad bytes from
    # every holder it tried (IntegrityError) is repeated with a fresh holder list, less the
    # suspects: a pipelined reader that starts from one predecessor must fall back to the
    # other holders when that predecessor fails it, whichever way it fails.
    retryable = (VersionUnavailable, IntegrityError)
    rounds = tenacity.Retrying(
        stop=tenacity.stop_after_attempt(4)
        | tenacity.stop_after_delay(max(0.0, deadline - time.monotonic())),
        wait=tenacity.wait_exponential(multiplier=0.05, max=1.0),
        retry=tenacity.retry_if_exception(
            lambda e: refresh_sources is not None and isinstance(e, retryable)
        ),
        reraise=True,
        sleep=lambda s: time.sleep(min(s, max(0.0, deadline - time.monotonic()))),
    )
    last: TensorHubError | None = None
    for attempt in rounds:
        with attempt:
            if dest.complete:
                break
            usable = [s for s in current if s.holder_id not in suspects]
            if usable:
                sched = _round(f, usable, me, parallel)
                suspects.update(sched.failures)
                if dest.complete:
                    break
                if time.monotonic() >= deadline:
                    raise DeadlineExceeded(
                        f"{what}: deadline passed with {len(dest.missing())} chunks missing"
                    )
                last = final_error(sched, what)
            elif not isinstance(last, IntegrityError):  # keep the most telling reason
                last = VersionUnavailable(f"{what}: no holder left")
            if refresh_sources is None or not isinstance(last, retryable):
                raise last
            current = _routed(f.stats, refresh_sources())
            raise last
    f.stats.duration = time.monotonic() - start
    return f.stats
