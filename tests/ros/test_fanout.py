"""The hub's shared watch: many streams, one etcd watch, exact start revisions, no loss."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import ros
from consistency import EventKind
from ros.hub.fanout import Subscription, WatchFanout, _PrivateSubscription
from ros.hub.server import HubServer
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from tests.ros.helpers import make_model


def test_many_watchers_share_one_watch_and_each_sees_every_version(
    hub_server: HubServer, connect: Callable[..., ros.Hub]
) -> None:
    trainer, client = connect(), connect()
    watches = [client.watch("policy") for _ in range(20)]
    for v in range(1, 6):
        trainer.publish("policy", v, make_model(v)).release(force=True)
    for watch in watches:
        seen = []
        while len(seen) < 5:
            event = watch.get(timeout=10)
            assert event is not None, f"watch saw only {seen}"
            if event.kind is EventKind.VERSION_PUBLISHED:
                seen.append(event.version)
        assert seen == [1, 2, 3, 4, 5]
        watch.close()
    shared = hub_server.servicer.hub.fanout._shared
    assert len(shared) <= 1  # one etcd watch for the model, not twenty


def test_a_late_start_revision_gets_a_private_replay(
    hub_server: HubServer, connect: Callable[..., ros.Hub]
) -> None:
    trainer = connect()
    first = trainer.publish("policy", 1, make_model(1))
    fanout: WatchFanout = hub_server.servicer.hub.fanout
    loop = asyncio.new_event_loop()  # subscribers are drained by a coroutine, as in the hub

    def get(sub: Subscription) -> pb.WatchEvent:
        return loop.run_until_complete(asyncio.wait_for(sub.next(), 10))

    live = fanout.subscribe("team-a", "policy", first.revision + 1, False, loop)
    trainer.publish("policy", 2, make_model(2))
    message = get(live)
    while message.kind != message.VERSION_PUBLISHED:
        message = get(live)
    assert message.version == 2
    # the shared watch has passed version 2; asking from version 1's revision replays it
    replay = fanout.subscribe("team-a", "policy", first.revision, False, loop)
    assert isinstance(replay, _PrivateSubscription)
    versions = []
    while len(versions) < 2:
        got = get(replay)
        if got.kind == got.VERSION_PUBLISHED:
            versions.append(got.version)
    assert versions == [1, 2]
    fanout.unsubscribe("team-a", "policy", replay)
    fanout.unsubscribe("team-a", "policy", live)
    assert ("team-a", "policy") not in fanout._shared
    loop.close()


def test_a_versions_only_watch_gets_new_versions_and_no_holder_churn(
    hub_server: HubServer, connect: Callable[..., ros.Hub]
) -> None:
    trainer, reader, client = connect(), connect(), connect()
    since = trainer.publish("policy", 1, make_model(1)).revision + 1
    full = client.watch("policy", since=since)
    lean = client.watch("policy", since=since, versions_only=True)
    for v in (2, 3):
        trainer.publish("policy", v, make_model(v))
        reader.fetch("policy", v).release()  # a reader: PARTIAL, COMPLETE, then removed
    every: list[EventKind] = []
    while EventKind.VERSION_PUBLISHED not in every or every.count(EventKind.HOLDER_REMOVED) < 2:
        event = full.get(timeout=10)
        assert event is not None, f"the full watch saw only {every}"
        every.append(event.kind)
    assert EventKind.HOLDER_UPDATED in every  # the unfiltered stream does carry the churn
    versions = []
    for _ in range(2):
        event = lean.get(timeout=10)
        assert event is not None
        assert event.kind is EventKind.VERSION_PUBLISHED, event
        versions.append(event.version)
    assert versions == [2, 3]
    assert lean.get(timeout=0.5) is None  # nothing else came: no holder events at all
    # a filtered stream that asks for history gets the same filter on its private replay
    replay = client.watch("policy", since=since, versions_only=True)
    assert [replay.get(timeout=10).version for _ in range(2)] == [2, 3]  # type: ignore[union-attr]
    for watch in (full, lean, replay):
        watch.close()
