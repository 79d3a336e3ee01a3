"""Conversions between consistency records and the hub's protobuf messages."""

from __future__ import annotations

from consistency.events import EventKind, WatchEvent
from consistency.records import HolderRecord, HolderState
from ros.manifest_check import check_topology
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from tensorhub.endpoints import validate_endpoints
from tensorhub.errors import InvalidArgument
from tensorhub.names import validate_name

_STATE_TO_PB = {HolderState.PARTIAL: pb.PARTIAL, HolderState.COMPLETE: pb.COMPLETE}
_STATE_FROM_PB = {v: k for k, v in _STATE_TO_PB.items()}
_KIND_TO_PB = {
    EventKind.VERSION_PUBLISHED: pb.WatchEvent.VERSION_PUBLISHED,
    EventKind.HOLDER_UPDATED: pb.WatchEvent.HOLDER_UPDATED,
    EventKind.HOLDER_REMOVED: pb.WatchEvent.HOLDER_REMOVED,
    EventKind.RESYNC: pb.WatchEvent.RESYNC,
}


def holder_to_pb(record: HolderRecord) -> pb.Holder:
    return pb.Holder(
        name=record.holder,
        endpoints=record.endpoints,
        topology=record.topology,
        state=_STATE_TO_PB[record.state],
        session_id=record.session,
        fence=record.revision,
        shard=record.shard,
    )


def holder_from_pb(
    message: pb.Holder, *, default_state: HolderState = HolderState.PARTIAL
) -> HolderRecord:
    """A HolderRecord from a request; validates the name (InvalidName), the state and every
    endpoint (`tensorhub.endpoints`), so nothing a reader cannot use reaches etcd."""
    if message.state == pb.HOLDER_STATE_UNSPECIFIED:
        state = default_state
    elif message.state in _STATE_FROM_PB:
        state = _STATE_FROM_PB[message.state]
    else:
        raise InvalidArgument(f"unknown holder state {message.state}")
    for label in ("dc", "rack", "host"):
        if len(message.topology.get(label, "")) > 253:
            raise InvalidArgument(f"topology label {label} is too long")
    check_topology(message.topology, f"topology of holder {message.name[:63]!r}")
    validate_name(message.name, "holder")  # the name's error first, as HolderRecord's
    # Every endpoint checked before any write: one a reader cannot use poisons the version.
    endpoints = validate_endpoints(message.endpoints)
    return HolderRecord(
        holder=message.name,
        endpoints=endpoints,
        topology=dict(message.topology),
        state=state,
        session=message.session_id,
        revision=message.fence,
        shard=message.shard if message.HasField("shard") else None,
    )


def event_to_pb(event: WatchEvent) -> pb.WatchEvent:
    message = pb.WatchEvent(
        kind=_KIND_TO_PB[event.kind],
        version=event.version,
        revision=event.revision,
        holder_name=event.holder_name,
    )
    if event.holder is not None:
        message.holder.CopyFrom(holder_to_pb(event.holder))
    for version, records in sorted(event.holders.items()):
        for record in records:
            message.holders.append(holder_to_pb(record))
            message.holder_versions.append(version)
    return message
