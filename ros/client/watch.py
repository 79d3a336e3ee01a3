"""A watch on a model through the hub that survives hub failover without losing or repeating
an event: it remembers the revision of the last event and reopens from the one after it,
and it refuses events older than the client's revision floor."""

from __future__ import annotations

import grpc

from consistency.events import EventKind, WatchEvent
from consistency.floor import RevisionFloor
from consistency.records import HolderRecord, HolderState
from consistency.retry import DEFAULT_POLICY, RetryPolicy
from consistency.stream import StreamPump
from ros.client.backoff import is_overloaded
from ros.errors import from_rpc_error
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from ros.proto.tensorhub.v1 import hub_pb2_grpc

_KINDS = {
    pb.WatchEvent.VERSION_PUBLISHED: EventKind.VERSION_PUBLISHED,
    pb.WatchEvent.HOLDER_UPDATED: EventKind.HOLDER_UPDATED,
    pb.WatchEvent.HOLDER_REMOVED: EventKind.HOLDER_REMOVED,
    pb.WatchEvent.RESYNC: EventKind.RESYNC,
}


def _named(exc: BaseException) -> BaseException:
    """What a watch that ended raises to its consumer: a gRPC error as its TensorHubError
    (Watch is a read: an UNKNOWN there is an `InternalError`, never `OutcomeUnknown`)."""
    return from_rpc_error(exc, "Watch") if isinstance(exc, grpc.RpcError) else exc


def holder_from_message(h: pb.Holder) -> HolderRecord:
    state = HolderState.COMPLETE if h.state == pb.COMPLETE else HolderState.PARTIAL
    shard = h.shard if h.HasField("shard") else None
    return HolderRecord(
        h.name, dict(h.endpoints), dict(h.topology), state, h.session_id, h.fence, shard
    )


def event_from_message(m: pb.WatchEvent) -> WatchEvent:
    holders: dict[int, list[HolderRecord]] = {}
    for version, h in zip(m.holder_versions, m.holders, strict=False):
        holders.setdefault(int(version), []).append(holder_from_message(h))
    return WatchEvent(
        kind=_KINDS[m.kind],
        version=int(m.version),
        revision=int(m.revision),
        holder=holder_from_message(m.holder) if m.HasField("holder") else None,
        holder_name=m.holder_name,
        holders=holders,
    )


class HubWatch(StreamPump[WatchEvent]):
    """Events of one model from `start_revision`, across hub replica failures."""

    def __init__(
        self,
        stub: hub_pb2_grpc.TensorHubStub,
        metadata: tuple[tuple[str, str], ...],
        model: str,
        start_revision: int,
        floor: RevisionFloor,
        versions_only: bool = False,
        policy: RetryPolicy = DEFAULT_POLICY,
    ) -> None:
        super().__init__(f"hub-watch-{model}")
        self._policy = policy
        self._stub = stub
        self._metadata = metadata
        self._model = model
        self._versions_only = versions_only
        self.next_revision = start_revision
        self._last_revision = start_revision - 1
        self._seen: set[tuple[EventKind, int, str]] = set()
        self._floor = floor
        self._start()

    def _run(self) -> None:
        """Reopen the stream from `next_revision` whenever it breaks, on the client's
        `RetryPolicy` (an `Overloaded` refusal on its slower schedule); a failure it does not
        retry (a refused token, a bad request) is raised to the consumer as its
        TensorHubError."""
        self._pump(self._policy, self._stream_once, _named)

    def _stream_once(self) -> None:
        request = pb.WatchRequest(
            model=self._model, start_revision=self.next_revision, versions_only=self._versions_only
        )
        try:
            call = self._stub.Watch(request, metadata=self._metadata)
            if not self._attach(call):
                return
            try:
                for message in call:
                    self._deliver(event_from_message(message))
            finally:
                self._detach()
        except grpc.RpcError as exc:
            if is_overloaded(exc):  # the replica is at its stream limit
                raise from_rpc_error(exc, "Watch") from exc
            raise

    def _deliver(self, event: WatchEvent) -> None:
        """Queue `event` unless it was delivered before a reconnect.

        One etcd revision can carry several events (a publish writes `latest` and a holder
        record together), so a stream that breaks mid-revision resumes *at* that revision,
        and the events of it already delivered are recognised by their identity.
        """
        ident = (
            event.kind,
            event.version,
            event.holder_name or (event.holder.holder if event.holder else ""),
        )
        if event.revision < self._last_revision:
            return
        if event.revision == self._last_revision and ident in self._seen:
            return
        if event.revision > self._last_revision:
            self._last_revision = event.revision
            self._seen = set()
        self._seen.add(ident)
        self._floor.observe(event.revision)
        self.next_revision = (
            event.revision + 1 if event.kind is EventKind.RESYNC else event.revision
        )
        self._put(event)
