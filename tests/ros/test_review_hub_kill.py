"""kill -9 of a hub replica in the middle of a publish and of a fetch (issue 25, "also
untested"): two real `tensorhub serve` processes over the real etcd, SDK clients given both.

"In the middle" is exact, not a sleep: each replica dials etcd through a `Tap`
(`tests/ros/etcd_tap.py`) that stops at the replica's request carrying a chosen key, the
publisher's or the reader's holder record. Then the replica is SIGKILLed either before that
request reached etcd (`drop`: nothing written) or after etcd applied it with its reply
withheld (`apply`: written, reply lost), the two cases a client cannot tell apart.

What must hold: a publish ends with a definite outcome that is true (the SDK checks the
surviving replica and resends only what did not land), or with `OutcomeUnknown` that
`latest`/`inspect` resolve; the model's keys are then consistent and its budget exact
(`tests/ros/review_state.py`). A fetch completes through the other replica, its holder
record COMPLETE under its own session, no pin left behind. A shard whose `OutcomeUnknown`
is settled by `latest` alone is still served (the SDK keeps what may have landed).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import ros
from consistency import Etcd, EtcdCluster, HolderState, Keys
from consistency.records import HolderRecord
from ros.hub.tenants import TenantStore
from tests.ros.etcd_tap import Tap
from tests.ros.helpers import digest, make_model
from tests.ros.review_hubs import Replica, start_replicas, stop_all
from tests.ros.review_state import charged_by_keys, read_model, usage_held, violations
from tests.waiting import wait_until

TENANT = "team-a"


@dataclass
class World:
    """Two replicas, each dialing etcd through its own tap; a client of the etcd itself."""

    etcd: Etcd
    keys: Keys
    token: str
    replicas: list[Replica]
    taps: list[Tap]

    @property
    def addresses(self) -> list[str]:
        return [r.address for r in self.replicas]

    def client(self, **kwargs: object) -> ros.Hub:
        return ros.connect(self.addresses, tenant=TENANT, token=self.token, **kwargs)  # type: ignore[arg-type]

    def arm(self, key: str, mode: str, nth: int = 1) -> None:
        """Both taps stop at the `nth` request carrying `key` (a key, or any bytes a
        request carries), whichever sees it: once."""
        group = threading.Event()
        for tap in self.taps:
            tap.arm(key.encode(), mode=mode, nth=nth, group=group)

    def kill_at_hit(self, *, applied: Callable[[], bool] | None = None) -> int:
        """Wait for a tap's hit, let `applied` become true in etcd if given (the write is
        there, its reply withheld), SIGKILL that tap's replica and cut its tap; its index."""
        wait_until(
            "a replica reached the chosen request",
            lambda: any(t.hit.is_set() for t in self.taps),
            30,
        )
        (index,) = [i for i, tap in enumerate(self.taps) if tap.hit.is_set()]
        if applied is not None:
            wait_until("etcd applied the request", applied, 10)
        self.replicas[index].kill()
        self.taps[index].close()
        return index


@pytest.fixture
def world(etcd_cluster: EtcdCluster, keys: Keys, tmp_path: Path) -> Iterator[World]:
    taps = [Tap(etcd_cluster.endpoints[0]) for _ in range(2)]
    replicas = start_replicas([[tap.endpoint] for tap in taps], keys.prefix, tmp_path)
    with Etcd(etcd_cluster.endpoints) as etcd:
        token = TenantStore(etcd, keys).create(TENANT)
        try:
            yield World(etcd, keys, token, replicas, taps)
        finally:
            stop_all(replicas)
            for tap in taps:
                tap.close()


def holder_record(world: World, model: str, version: int, holder: str) -> HolderRecord | None:
    kv, _ = world.etcd.get(world.keys.holder(TENANT, model, version, holder))
    return HolderRecord.decode(kv.value) if kv is not None else None


def consistent(world: World, model: str) -> None:
    state = read_model(world.etcd, world.keys, TENANT, model)
    assert not violations(state), violations(state)
    assert usage_held(world.etcd, world.keys, TENANT) == charged_by_keys(
        world.etcd, world.keys, TENANT
    )


@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", ["drop", "apply"])
def test_kill_9_of_the_replica_in_the_middle_of_a_publish(world: World, mode: str) -> None:
    """policy@2's publish transaction is stopped on its way to etcd (`drop`) or applied with
    its reply lost (`apply`), and the replica carrying it is SIGKILLed. Proves: `publish`
    returns a Publication (the SDK asks the other replica whether its holder record is
    there, and sends the publish again only when it is not) or raises `OutcomeUnknown`
    that `latest`/`inspect` settle; policy@2 is then visible once, with exactly the
    publisher's record, and a reader fetches its bytes through the surviving replica."""
    publisher = world.client(session_ttl=10)
    reader = world.client(session_ttl=10)
    try:
        publisher.publish("policy", 1, make_model(1)).release(force=True)
        world.arm(world.keys.holder(TENANT, "policy", 2, publisher.holder_name), mode)
        outcome: list[object] = []

        def publish() -> None:
            try:
                outcome.append(publisher.publish("policy", 2, make_model(2), timeout=30))
            except ros.TensorHubError as exc:
                outcome.append(exc)

        thread = threading.Thread(target=publish)
        thread.start()
        world.kill_at_hit(
            applied=(lambda: holder_record(world, "policy", 2, publisher.holder_name) is not None)
            if mode == "apply"
            else None
        )
        thread.join(40)
        (result,) = outcome
        if isinstance(result, ros.OutcomeUnknown):  # settle it as the error says to
            landed = publisher.latest("policy") == 2 and publisher.holder_name in [
                h.holder for h in publisher.holders("policy", 2)
            ]
            if not landed:
                result = publisher.publish("policy", 2, make_model(2), timeout=30)
        assert isinstance(result, ros.Publication), f"{mode}: {result!r}"
        assert publisher.latest("policy") == 2
        assert [(h.holder, h.session) for h in publisher.holders("policy", 2)] == [
            (publisher.holder_name, publisher.session.id)
        ]
        held = reader.fetch("policy", 2, timeout=30)
        assert digest(held.tensors) == digest(make_model(2))
        consistent(world, "policy")
    finally:
        reader.close()
        publisher.close()


SHARDS = [make_model(10 + i) for i in range(2)]  # rank i's shard of mp@1


def kill_mid_last_shard(world: World, ranks: list[ros.Hub]) -> object:
    """Rank 1 publishes its shard of mp@1; rank 0's, the one that makes mp@1 visible, is
    applied by etcd (its batch's write: the first request that puts its holder record,
    whose value names it, whether the batch read first or, on the replica that committed
    rank 1's batch, sent its transaction on the state that batch left) with its reply
    lost, and the replica is SIGKILLed. What rank 0's publish returned or raised."""
    ranks[1].publish("mp", 1, SHARDS[1], shard=(1, 2))
    world.arm(f'"holder": "{ranks[0].holder_name}"', "apply", nth=1)
    outcome: list[object] = []

    def publish() -> None:
        try:
            outcome.append(ranks[0].publish("mp", 1, SHARDS[0], shard=(0, 2), timeout=30))
        except ros.TensorHubError as exc:
            outcome.append(exc)

    def visible() -> bool:
        return world.etcd.get(world.keys.latest(TENANT, "mp"))[0] is not None

    thread = threading.Thread(target=publish)
    thread.start()
    world.kill_at_hit(applied=visible)
    thread.join(40)
    (result,) = outcome
    return result


@pytest.mark.timeout(90)
def test_kill_9_of_the_replica_in_the_middle_of_the_last_shard_of_a_version(
    world: World,
) -> None:
    """`kill_mid_last_shard`. A shard cannot be looked up before its version is visible,
    so the SDK may answer `OutcomeUnknown`; here `latest` settles it, and the rank's retry
    of the same shard (idempotent) gives it back its Publication. Proves: mp@1 is visible
    once with both shards, and a reader fetches rank 0's exact shard from rank 0."""
    ranks = [world.client(session_ttl=10) for _ in range(2)]
    reader = world.client(session_ttl=10)
    try:
        result = kill_mid_last_shard(world, ranks)
        if isinstance(result, ros.OutcomeUnknown):
            assert ranks[0].latest("mp") == 1  # it landed: the version is visible
            result = ranks[0].publish("mp", 1, SHARDS[0], shard=(0, 2), timeout=30)
        assert isinstance(result, ros.Publication), repr(result)
        assert reader.latest("mp") == 1
        held = reader.fetch("mp", 1, shard=0, timeout=30)
        assert digest(held.tensors) == digest(SHARDS[0])
        state = read_model(world.etcd, world.keys, TENANT, "mp")
        assert state.headers[1].shards == 2
        consistent(world, "mp")
    finally:
        for client in (reader, *ranks):
            client.close()


@pytest.mark.timeout(90)
def test_a_shard_whose_outcome_unknown_is_settled_by_latest_is_still_served(
    world: World,
) -> None:
    """`kill_mid_last_shard` answers `OutcomeUnknown`; rank 0 settles it by reading
    `latest` (mp@1 is visible: its shard landed), as the error tells it to, and does not
    publish again. Proves (when it passes): a reader then fetches shard 0, whose only
    holder is rank 0, with rank 0's bytes."""
    ranks = [world.client(session_ttl=10) for _ in range(2)]
    reader = world.client(session_ttl=10)
    try:
        result = kill_mid_last_shard(world, ranks)
        if not isinstance(result, ros.OutcomeUnknown):  # not the case under test (any more)
            pytest.skip(f"the SDK settled the shard's outcome itself: {result!r}")
        assert ranks[0].latest("mp") == 1  # settled: it landed
        (record,) = [h for h in reader.holders("mp", 1) if h.shard == 0]
        assert (record.holder, record.session) == (ranks[0].holder_name, ranks[0].session.id)
        held = reader.fetch("mp", 1, shard=0, timeout=10)
        assert digest(held.tensors) == digest(SHARDS[0])
    finally:
        for client in (reader, *ranks):
            client.close()


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("step", "mode", "nth"),
    [("register", "drop", 1), ("register", "apply", 1), ("complete", "apply", 2)],
)
def test_kill_9_of_the_replica_in_the_middle_of_a_fetch(
    world: World, step: str, mode: str, nth: int
) -> None:
    """The reader's RegisterHolder (PARTIAL, its 1st request naming its record) or
    UpdateHolder (COMPLETE: one transaction that compares the PARTIAL record, its 2nd) is
    stopped or applied with its reply lost, and the replica carrying it is SIGKILLed.
    Proves: the fetch still returns within its timeout, through the other replica, with the
    publisher's bytes; the reader's record is COMPLETE under its own session, and no pin of
    it is left."""
    publisher = world.client(session_ttl=10)
    reader = world.client(session_ttl=10)
    try:
        model = make_model(7)
        publisher.publish("policy", 1, model)
        key = world.keys.holder(TENANT, "policy", 1, reader.holder_name)
        world.arm(key, mode, nth)
        outcome: list[object] = []

        def fetch() -> None:
            try:
                outcome.append(reader.fetch("policy", 1, timeout=30))
            except ros.TensorHubError as exc:
                outcome.append(exc)

        def applied() -> bool:
            record = holder_record(world, "policy", 1, reader.holder_name)
            want = HolderState.PARTIAL if step == "register" else HolderState.COMPLETE
            return record is not None and record.state is want

        thread = threading.Thread(target=fetch)
        thread.start()
        world.kill_at_hit(applied=applied if mode == "apply" else None)
        thread.join(40)
        (held,) = outcome
        assert isinstance(held, ros.Held), f"{step}/{mode}: {held!r}"
        assert digest(held.tensors) == digest(model)
        record = holder_record(world, "policy", 1, reader.holder_name)
        assert record is not None
        assert record.state is HolderState.COMPLETE
        assert record.session == reader.session.id
        pins = world.etcd.range(world.keys.pins(TENANT, "policy", 1), prefix=True).kvs
        assert not pins, [kv.key for kv in pins]
        consistent(world, "policy")
    finally:
        reader.close()
        publisher.close()
