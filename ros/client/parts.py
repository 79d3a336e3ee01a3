"""The parts of one client, built and joined: the composition root behind `ros.Hub`.

`ros.client.hub` is the public API and says what a client does; this module says what it is
made of and who gets what. `assemble` builds every part once and hands each helper only the
narrow handles it needs:

- `ros.client.rpc` (`HubRpc`: every unary call, and its one retry), `ros.client.reads`
  (`FreshReads`: reads never older than the revision floor);
- `ros.client.session` (`Session`: the lease, its keepalive, its recovery, the read keys);
- `ros.client.holdings` (what the client serves), `ros.client.serving` (the servers it
  serves from), `ros.client.records` (its holder records), `ros.client.pins`;
- `ros.client.publishing` (`Publisher`), `ros.client.orchestrator` (`Orchestrator`: every
  fetch's steps after its Resolve) with `ros.client.fetching`, `ros.client.slices` and
  `ros.client.delta_fetch` (`DeltaReader`: a delta's companion is one more target of the
  fetch's orchestrator), and `ros.client.retention` (release, spills);
- `ros.client.handles` (`Handles`: what publish and fetch return), given how to release,
  this client's holder name, and how to open a watch;
- `ros.client.layouts` (`LayoutPeers`: readers in another layout), whose held blocks a
  session recovery registers again.

Nothing here holds the `Hub`: `Parts` is what the `Hub` keeps, and the closures built here
close over parts, never over the client (tests/ros/test_no_helper_holds_the_hub.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from consistency.floor import RevisionFloor
from consistency.retry import RetryPolicy
from ros.client import shard_frames
from ros.client.channel import open_channel
from ros.client.delta_fetch import DeltaReader
from ros.client.handles import Handles
from ros.client.holdings import Holdings
from ros.client.hooks import ClientHooks
from ros.client.identity import Identity
from ros.client.layouts import LayoutHoldings, LayoutPeers
from ros.client.layouts import reregister as reregister_layout
from ros.client.orchestrator import Orchestrator
from ros.client.pins import Pins
from ros.client.publishing import Publisher
from ros.client.reads import FreshReads
from ros.client.records import HolderRecords
from ros.client.retention import Retention
from ros.client.rpc import HubRpc, Rpc
from ros.client.serving import Serving
from ros.client.session import Session
from ros.client.watch import HubWatch
from ros.proto.tensorhub.v1 import hub_pb2_grpc
from transport.backend import TransportKind
from transport.transports import ReaderBackends


@dataclass(frozen=True)
class Parts:
    """What a connected client keeps (module docstring): each part built once."""

    metadata: tuple[tuple[str, str], ...]  # on every call: the tenant's token, the tenant
    channel: grpc.Channel
    stub: hub_pb2_grpc.TensorHubStub
    floor: RevisionFloor  # invariant 3 (chaos may wrap it)
    holdings: Holdings  # what this client serves: the one owner of it
    session: Session
    rpc: Rpc  # every unary hub call, typed by method
    reads: FreshReads
    serving: Serving
    retention: Retention
    handles: Handles
    pins: Pins
    publisher: Publisher
    readers: ReaderBackends  # this client's reader side of each transport
    fetches: Orchestrator  # stateless: every run keeps its state on its stack
    layouts: LayoutPeers  # readers in another layout (`fetch_slices(layout=)`)
    deltas: DeltaReader


def assemble(
    addresses: Sequence[str],
    me: Identity,
    token: str,
    *,
    listen_at: tuple[str, int],
    advertise: str | None,
    session_ttl: int,
    hooks: ClientHooks,
    spill_budget: int | None,
    retry: RetryPolicy,
    kinds: Sequence[TransportKind],
    delta_hold_bytes: int,
) -> Parts:
    """Build the parts of a client of `me` (its arguments checked by the `Hub`), and open
    its session; a session the hub refuses (a bad token, another tenant's token) closes the
    channel and raises."""
    timeout, tls = me.timeout, me.tls
    # The tenant travels on every call: the hub refuses a token of another tenant.
    metadata = (("authorization", f"Bearer {token}"), ("tensorhub-tenant", me.tenant))
    channel = open_channel(addresses, tls=tls)
    stub = hub_pb2_grpc.TensorHubStub(channel)  # type: ignore[no-untyped-call]
    # a group's leader sends its ranks' requests framed as they were serialized
    stub.PublishShards = shard_frames.publish_shards(channel)
    floor = hooks.floor(RevisionFloor())
    holdings = Holdings(me.tenant)
    session = Session(
        HubRpc(stub, metadata, timeout, lambda: None, policy=None),
        tenant=me.tenant, ttl=session_ttl, timeout=timeout, stub=stub, metadata=metadata,
        keepalive=retry, holdings=holdings, observe=floor.observe,
    )  # fmt: skip
    # every unary hub call; its `once` for callers with their own policy
    rpc = HubRpc(stub, metadata, timeout, lambda: session.current)
    reads = FreshReads(
        rpc.once, floor, retry, timeout=timeout, holder_name=me.holder_name,
        topology=me.topology,
    )  # fmt: skip
    serving = Serving(
        holdings.store, session.verify, listen_at, advertise=advertise, tls=tls,
        send=hooks.send, kinds=kinds,
    )  # fmt: skip
    records = HolderRecords(
        rpc, floor, serving, session, holder_name=me.holder_name, topology=me.topology
    )
    retention = Retention(records, holdings, spill_budget)

    def open_watch(model: str, since: int) -> HubWatch:  # what a Publication waits on
        return HubWatch(stub, metadata, model, since, floor, False, retry)

    handles = Handles(retention, me.holder_name, open_watch)
    pins = Pins(rpc, session)
    publisher = Publisher(me, rpc.once, reads, records, holdings, serving, handles)
    readers = ReaderBackends(kinds)
    if TransportKind.NIXL in kinds:  # its agent now, not in the first fetch's time
        readers.get(TransportKind.NIXL)
    fetches = Orchestrator(
        me, reads, records, holdings, serving, hooks.reader(), readers,
        ranges=hooks.range_reader(),
    )  # fmt: skip
    layouts = LayoutPeers(
        rpc, holdings, serving, records, LayoutHoldings(), hooks.reader(), readers
    )
    # a session recovery registers the held blocks again
    holdings.register_layout = lambda m, v: reregister_layout(layouts, me, m, v)
    parts = Parts(
        metadata=metadata, channel=channel, stub=stub, floor=floor, holdings=holdings,
        session=session, rpc=rpc, reads=reads, serving=serving, retention=retention,
        handles=handles, pins=pins, publisher=publisher, readers=readers, fetches=fetches,
        layouts=layouts, deltas=DeltaReader(fetches, holdings, handles, delta_hold_bytes),
    )  # fmt: skip
    try:
        session.open(
            lambda model, version, complete, shard: int(
                records.register(model, version, complete=complete, shard=shard, rpc=rpc.once).fence
            )
        )
    except BaseException:  # refused at connect (a bad token, another tenant's token)
        channel.close()
        raise
    return parts
