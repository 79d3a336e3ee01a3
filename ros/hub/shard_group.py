"""PublishShards: a process group's shards of one version in one call.

A trainer's ranks gather their shards' PublishRequests over their own process group, and one
rank streams them all to the hub in one `PublishShards` call (a client stream: no message
bound on how many, nor on their manifests together; a message carries one shard, or
several in its `shards`, as many as the sender framed). The hub treats each shard as its own
`Publish`: checked as it arrives, on the event loop, then staged `CHUNK` (61, a full batch)
at a time in one worker (a manifest over `SHARD_INLINE_BYTES`, up to `SHARD_PACK_BYTES`,
hashed and compressed for its batch's pack, `consistency.manifest_packs`, instead of paged
before the batch: work that releases the GIL, so it runs beside the loop's reading and
checking of the next shards instead of making the loop wait to take the GIL back; a call's
chunks are staged one at a time, in order: each manifest's hash and compression release
the GIL and take it back, so one thread, not one a chunk, takes turns at the GIL with the
loop that reads the stream), then
handed to the version's group commits (`ros.hub.shard_publish`) `CHUNK` at a time, so N shards cost
ceil(N / 61) transactions, whatever else the replica is doing, and the version becomes
visible with the last one, atomically. Each shard keeps its own holder record under its own
rank's session (the rank serves its own memory, and its record dies with its lease), its own
outcome (a refused shard is refused alone, with its named error, and the version stays
invisible), its retry-safety (a shard sent again is recognized as its earlier write), and
the tenant's quotas (the batches charge the publish rate by arrival: N shards take
`consistency.usage.shard_tokens(0, N)` however they arrive).

The answer lists one `ShardOutcome` per shard, in the order sent. A call is refused whole
(`InvalidArgument`) when it carries no shard, when its first shard has no shard count, when
a message sets both `shards` and a field of its own, or when it carries more shards than
its version has (at most `MAX_SHARDS`: a stream is bounded by the count its first shard
states). The shards it carried before that were committed or withdrawn as those of a
Publish whose caller left; sent again, they are recognized. A shard of another model,
version or shard count than the first is refused alone, as is a shard that carries
`shards` of its own.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TypeVar

from consistency.manifests import MAX_SHARDS
from consistency.publishing import Published
from consistency.shard_entries import FULL_BATCH
from ros.errors import ERROR_METADATA_KEY, FIELDS_METADATA_KEY, error_metadata
from ros.hub.call import internal
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from tensorhub.errors import InvalidArgument, TensorHubError

C = TypeVar("C")  # a checked shard, as `check` makes it and `stage` takes it
J = TypeVar("J")  # a staged shard, as `stage` makes it and `commit` takes it
K = TypeVar("K")
CHUNK = FULL_BATCH  # shards staged before a call hands them to the batches together


async def publish_shards(
    requests: AsyncIterator[pb.PublishRequest],
    check: Callable[[pb.PublishRequest], Awaitable[C]],
    stage: Callable[[list[C]], Awaitable[list[J | BaseException]]],
    commit: Callable[[list[J]], list[asyncio.Future[Published]]],
    verify: Callable[[list[C]], Awaitable[list[C]]] | None = None,
) -> pb.PublishShardsResponse:
    """Publish every shard of the stream (module docstring); one outcome each, in order.
    Each shard is checked as it arrives (`check`), every `CHUNK` checked shards are staged
    together (`stage`: each one's staged shard or its error, in order; its manifest ready
    for a batch's pack; one chunk of the call at a time) and handed to the batches together
    (`commit`), so the first
    batches commit, full, while the rest still streams in. If the call ends early
    (cancelled, refused), the shards not yet committed are withdrawn as a Publish whose
    caller left is. `verify`: a step over each chunk's checked shards before they are
    staged (the same shards, in order, each as `stage` takes it), started as soon as the
    chunk is checked, beside the staging of the chunks before it."""
    lane = asyncio.Lock()  # a call's chunks staged one at a time, in order (FIFO)

    async def staged_in_turn(checked: list[C]) -> list[J | BaseException]:
        verified = asyncio.ensure_future(verify(checked)) if verify is not None else None
        try:
            async with lane:
                return await stage(checked if verified is None else await verified)
        finally:
            if verified is not None:
                verified.cancel()  # no-op once done

    outcomes: list[asyncio.Future[Published]] = []
    indices: list[int] = []
    first: tuple[str, int, int] | None = None
    chunk: list[tuple[asyncio.Future[C], asyncio.Future[Published]]] = []
    handing: list[asyncio.Future[None]] = []
    loop = asyncio.get_running_loop()
    try:
        async for message in requests:
            for request in _carried(message):
                this = (request.model, request.version, request.shard_count)
                if first is None:
                    if not request.shard_count:
                        raise InvalidArgument("PublishShards carries shards: set shard_count")
                    first = this
                if len(outcomes) >= min(first[2], MAX_SHARDS):
                    raise InvalidArgument(
                        f"PublishShards carries at most one request per shard of its version "
                        f"({min(first[2], MAX_SHARDS)} here)"
                    )
                indices.append(request.shard_index)
                if this != first:
                    outcomes.append(_refused(_mismatch(first, this)))
                    continue
                outcome: asyncio.Future[Published] = loop.create_future()
                outcomes.append(outcome)
                chunk.append((asyncio.ensure_future(check(request)), outcome))
                if len(chunk) >= CHUNK:
                    handing.append(asyncio.ensure_future(_hand_in(chunk, staged_in_turn, commit)))
                    chunk = []
        if chunk:
            handing.append(asyncio.ensure_future(_hand_in(chunk, staged_in_turn, commit)))
        if not outcomes:
            raise InvalidArgument("PublishShards carried no shard")
        results = await asyncio.gather(*outcomes, return_exceptions=True)
    finally:
        for task in handing:
            task.cancel()  # no-op for those done
        for checked, _ in chunk:
            checked.cancel()
        for future in outcomes:
            future.cancel()  # a shard still waiting for its batch is withdrawn
    version = first[1] if first is not None else 0
    return pb.PublishShardsResponse(
        version=version,
        outcomes=[_outcome(i, o) for i, o in zip(indices, results, strict=True)],
    )


def _carried(message: pb.PublishRequest) -> Sequence[pb.PublishRequest]:
    """The shards one message of the stream carries: its `shards`, or itself (a message
    that sets `shards` and any other field is refused, with the whole call: a stream
    whose framing is broken says nothing sure of its shards)."""
    shards = message.shards
    if not shards:
        return (message,)
    if len(message.ListFields()) > 1:
        raise InvalidArgument(
            "a PublishShards message carries its own shard or its `shards`, not both"
        )
    return shards


async def _hand_in(
    chunk: list[tuple[asyncio.Future[C], asyncio.Future[Published]]],
    stage: Callable[[list[C]], Awaitable[list[J | BaseException]]],
    commit: Callable[[list[J]], list[asyncio.Future[Published]]],
) -> None:
    """Wait for a chunk's shards to be checked, stage those that passed together, then
    hand those staged to the batches in one step; each shard's outcome (its check's or its
    staging's error, or its batch's answer) goes to its own future. An outcome cancelled
    (the call ended) withdraws its shard."""
    checked = await asyncio.gather(*(c for c, _ in chunk), return_exceptions=True)
    passed = _passed(chunk, checked)
    try:
        staged = await stage([c for c, _ in passed]) if passed else []
    except Exception as exc:  # nothing staged (the call's deadline passed): each hears why
        staged = [exc] * len(passed)
    ready = _passed(passed, staged)
    try:
        committing = commit([j for j, _ in ready])
    except Exception as exc:  # nothing handed in: each shard hears why
        for _, outcome in ready:
            outcome.set_exception(exc)
        return
    for waiting, (_, outcome) in zip(committing, ready, strict=True):
        waiting.add_done_callback(functools.partial(_settle, outcome))
        outcome.add_done_callback(functools.partial(_withdraw, waiting))


def _passed(
    chunk: Sequence[tuple[object, asyncio.Future[Published]]],
    results: Sequence[K | BaseException],
) -> list[tuple[K, asyncio.Future[Published]]]:
    """The results of a step over `chunk` that passed, each with its shard's outcome; each
    shard that failed hears its error, and one whose step was cancelled is withdrawn (as
    is one whose outcome is already decided: the call ended)."""
    passed: list[tuple[K, asyncio.Future[Published]]] = []
    for (_, outcome), result in zip(chunk, results, strict=True):
        if outcome.done():
            continue
        if isinstance(result, asyncio.CancelledError):
            outcome.cancel()
        elif isinstance(result, BaseException):
            outcome.set_exception(result)
        else:
            passed.append((result, outcome))
    return passed


def _settle(outcome: asyncio.Future[Published], waiting: asyncio.Future[Published]) -> None:
    """A batch's answer to a shard, handed to the shard's outcome."""
    if outcome.done():
        return
    if waiting.cancelled():
        outcome.cancel()
    elif (error := waiting.exception()) is not None:
        outcome.set_exception(error)
    else:
        outcome.set_result(waiting.result())


def _withdraw(waiting: asyncio.Future[Published], outcome: asyncio.Future[Published]) -> None:
    """The call ended before the shard's batch answered: its wait is cancelled, so a batch
    not yet taken leaves it out (`ros.hub.group_commit`)."""
    if outcome.cancelled():
        waiting.cancel()


def _mismatch(first: tuple[str, int, int], this: tuple[str, int, int]) -> InvalidArgument:
    return InvalidArgument(
        f"PublishShards carries shards of one version ({first[0]}@{first[1]}, {first[2]} "
        f"shards); this one is of {this[0]}@{this[1]}, {this[2]} shards"
    )


def _refused(error: TensorHubError) -> asyncio.Future[Published]:
    future: asyncio.Future[Published] = asyncio.get_running_loop().create_future()
    future.set_exception(error)
    return future


def _outcome(index: int, outcome: Published | BaseException) -> pb.ShardOutcome:
    """One shard's outcome: its commit, or its error as its own Publish would name it."""
    if isinstance(outcome, Published):
        return pb.ShardOutcome(
            shard_index=index, revision=outcome.revision, visible=outcome.visible
        )
    if isinstance(outcome, asyncio.CancelledError):
        raise outcome
    error = (
        outcome
        if isinstance(outcome, TensorHubError)
        else internal("PublishShards", outcome if isinstance(outcome, Exception) else Exception())
    )
    metadata = dict(error_metadata(error))
    return pb.ShardOutcome(
        shard_index=index,
        error=metadata[ERROR_METADATA_KEY],
        message=str(error),
        fields=metadata.get(FIELDS_METADATA_KEY, ""),
    )
