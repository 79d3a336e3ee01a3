"""`publish(..., group=PG)`: one hub call per version for a process group's shards.

Every rank of the group builds its shard's PublishRequest exactly as its own publish would:
its manifest, its holder record under its own session, naming its own endpoint, and its
parts of the publisher's checksums of the model's declared layouts with the declarations'
revision it read (`ros.client.publisher_sums.layout_parts`), which the hub writes with its
shard as it does a shard published alone. So each
rank still serves its own memory, and its holder record lives and dies with its own lease:
a rank that dies stops being offered to readers when its lease expires, within the TTL, as
a rank that publishes alone does (docs/design-notes.md, "One hub call per version"). Only
the sending changes: the ranks gather their requests (serialized, a few KB each) over their
`torch.distributed` group to the group's first rank, which streams them all to the hub in one
`PublishShards` call (`ros.hub.shard_group`), framed many a message as the ranks serialized
them (`ros.client.shard_frames`), and scatters each rank its own shard's outcome.
Each rank then finishes its publish as if its own Publish had answered: a `Publication`, or
the named error its shard was refused with. Since every rank returns after the whole call,
each one's `Publication.visible` says whether the version is visible by then (its revision
stays its own shard's commit).

Every rank takes part in the exchange once per publish, even one whose publish failed before
it had a request, or that publishes no block (a replica of a DTensor state dict): it joins
with nothing to send, so that the others are never left waiting in the gather. The
collectives are bounded by the process group's own timeout (`init_process_group(timeout=)`).
A call that fails on the way (the replica died, the deadline passed) leaves every rank's
outcome unknown (`OutcomeUnknown`): publishing again is safe, since the hub recognizes each
shard it already has by its holder and session.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from ros.client.rpc import Rpc
from ros.client.shard_frames import frames
from ros.errors import ERROR_METADATA_KEY, FIELDS_METADATA_KEY, error_metadata, from_outcome
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from tensorhub.errors import (
    DeadlineExceeded,
    InvalidArgument,
    OutcomeUnknown,
    TensorHubError,
    Unavailable,
)

log = logging.getLogger(__name__)

Send = Callable[[pb.PublishRequest, float | None], pb.PublishResponse]
ProcessGroup = Any  # a torch.distributed ProcessGroup (its stubs are not typed)
T = TypeVar("T")


class ShardGroup:
    """One group publish, on one rank: `send` is this rank's Publish through the group."""

    def __init__(self, group: ProcessGroup | None, rpc: Rpc) -> None:
        if not dist.is_initialized():
            raise InvalidArgument("publish(group=...) needs torch.distributed initialized")
        self._group: ProcessGroup = group if group is not None else dist.group.WORLD
        self._rpc = rpc  # the leader's hub call, tried once
        self.joined = False

    def send(self, request: pb.PublishRequest, timeout: float | None) -> pb.PublishResponse:
        """This rank's shard through the group's one call: its answer, or its error."""
        outcome, version = self.join(request, timeout)
        if outcome is None:
            raise OutcomeUnknown(f"shard {request.shard_index}: the group's call did not carry it")
        if outcome.error:
            raise from_outcome(outcome.error, outcome.message, outcome.fields)
        return pb.PublishResponse(
            version=version, revision=outcome.revision, visible=outcome.visible
        )

    def join(
        self, request: pb.PublishRequest | None, timeout: float | None
    ) -> tuple[pb.ShardOutcome | None, int]:
        """Take part in the exchange with `request` (None: nothing to send); this rank's
        outcome (None if it sent nothing) and the version the hub answered for."""
        self.joined = True
        group = self._group
        leader = dist.get_global_rank(group, 0)
        me = dist.get_rank(group)
        size = dist.get_world_size(group)
        payload = None if request is None else request.SerializeToString()
        gathered: list[bytes | None] | None = [None] * size if me == 0 else None
        dist.gather_object(payload, gathered, dst=leader, group=group)
        answers: list[tuple[bytes | None, int]] | None = None
        if me == 0:
            assert gathered is not None
            answers = _send_all(self._rpc, gathered, timeout)
        mine: list[tuple[bytes | None, int] | None] = [None]
        dist.scatter_object_list(mine, answers, src=leader, group=group)
        raw, version = mine[0] or (None, 0)
        return (None if raw is None else pb.ShardOutcome.FromString(raw)), version


def _send_all(
    rpc: Rpc, gathered: list[bytes | None], timeout: float | None
) -> list[tuple[bytes | None, int]]:
    """The leader's part: every request in one PublishShards call; each rank's outcome
    (serialized, None for a rank that sent nothing) and the version answered."""
    sent = [i for i, raw in enumerate(gathered) if raw is not None]
    answers: list[tuple[bytes | None, int]] = [(None, 0)] * len(gathered)
    if not sent:
        return answers
    requests = [gathered[i] or b"" for i in sent]
    try:  # the requests as the ranks serialized them, many a message (`shard_frames`)
        answer = rpc("PublishShards", frames(requests), timeout)
        if len(answer.outcomes) != len(sent):
            raise OutcomeUnknown(
                f"the hub answered {len(answer.outcomes)} outcomes for {len(sent)} shards"
            )
    except TensorHubError as exc:
        error = exc
        if isinstance(exc, Unavailable | DeadlineExceeded | OutcomeUnknown):
            first = pb.PublishRequest.FromString(requests[0])
            error = OutcomeUnknown(
                f"the group publish of {first.model}@{first.version} was not confirmed "
                f"({type(exc).__name__}: {exc}); publish again: shards that landed are "
                "recognized"
            )
        failed = _failed(error)
        return [(failed if i in sent else None, 0) for i in range(len(gathered))]
    # every rank returns after the whole call: if its last batch made the version visible,
    # it is visible for each of them (each keeps its own shard's commit revision)
    visible = any(o.visible for o in answer.outcomes)
    for i, outcome in zip(sent, answer.outcomes, strict=True):
        outcome.visible = visible and not outcome.error
        answers[i] = (outcome.SerializeToString(), int(answer.version))
    return answers


def _failed(error: TensorHubError) -> bytes:
    metadata = dict(error_metadata(error))
    return pb.ShardOutcome(
        error=metadata[ERROR_METADATA_KEY],
        message=str(error),
        fields=metadata.get(FIELDS_METADATA_KEY, ""),
    ).SerializeToString()


def publish_in_group(group: ProcessGroup | None, rpc: Rpc, publish: Callable[[Send], T]) -> T:
    """Run `publish(send)` (this rank's publish, its Publish call replaced by `send`) so
    that this rank joins the group's exchange exactly once, whatever happens before."""
    sender = ShardGroup(group, rpc)
    try:
        result = publish(sender.send)
    except BaseException:
        if not sender.joined:  # failed before it had a request: the others still gather
            with contextlib.suppress(Exception):
                sender.join(None, None)
        raise
    if not sender.joined:  # published nothing (a rank that owns no block)
        sender.join(None, None)
    return result
