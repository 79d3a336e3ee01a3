"""The hub's shared watch: many streams, one etcd watch, exact start revisions, no loss."""

from __future__ import annotations

from collections.abc import Callable

import ros
from consistency import EventKind
from ros.hub.fanout import WatchFanout, _PrivateSubscription
from ros.hub.server import HubServer
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
    shared = hub_server.servicer._fanout._shared
    assert len(shared) <= 1  # one etcd watch for the model, not twenty


def test_a_late_start_revision_gets_a_private_replay(
    hub_server: HubServer, connect: Callable[..., ros.Hub]
) -> None:
    trainer = connect()
    first = trainer.publish("policy", 1, make_model(1))
    fanout: WatchFanout = hub_server.servicer._fanout
    live = fanout.subscribe("team-a", "policy", first.revision + 1)
    trainer.publish("policy", 2, make_model(2))
    message = None
    while message is None or message.kind != message.VERSION_PUBLISHED:
        message = live.get(timeout=10)
        assert message is not None
    assert message.version == 2
    # the shared watch has passed version 2; asking from version 1's revision replays it
    replay = fanout.subscribe("team-a", "policy", first.revision)
    assert isinstance(replay, _PrivateSubscription)
    versions = []
    while len(versions) < 2:
        got = replay.get(timeout=10)
        assert got is not None
        if got.kind == got.VERSION_PUBLISHED:
            versions.append(got.version)
    assert versions == [1, 2]
    fanout.unsubscribe("team-a", "policy", replay)
    fanout.unsubscribe("team-a", "policy", live)
    assert ("team-a", "policy") not in fanout._shared
