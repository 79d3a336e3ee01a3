"""The version and holder registries against a plain in-memory model (Hypothesis stateful).

Every step runs against a real etcd and against `_Model`, a few dicts that say what
docs/design.md promises: publish moves `latest` only upwards (a stale publish raises
`StaleVersion` and
writes nothing), two racing publishers of one version get exactly one winner, holders are
fenced by their record's create revision, a retained version's last complete holder cannot
leave silently, a lease's end removes its holder records and pins, and retention keeps the
newest N versions plus pinned ones. After every step the registry must agree with the model.

Lease expiry inside the machine is a revoke (immediate and deterministic); the plain test
at the end waits for a real 1 s TTL to run out and checks the same consequences.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import TypeVar

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from consistency import (
    Etcd,
    EtcdCluster,
    HolderRecord,
    HolderRegistry,
    HolderState,
    Keys,
    KeyWatch,
    Published,
    Session,
    VersionRegistry,
)
from tensorhub.errors import (
    LeaseLost,
    RetentionViolation,
    StaleVersion,
    VersionNotFound,
    VersionRetired,
)

TENANT = "t"
MODEL = "m"
RETAIN = 2
SLOTS = 2  # sessions alive at once; a slot gets a fresh session after its lease ends
HOLDERS = ("h0", "h1", "h2")
PINS = ("p0", "p1")
ENDPOINTS = {"tcp": "127.0.0.1:9"}
CALL_TIMEOUT = 10.0  # generous: two busy cores are shared with other test runs

Slot = int
HolderKey = tuple[int, str]  # (version, holder name)
T = TypeVar("T")

# Every draw has the same shape whatever the state: which of two racing publishers wins
# differs between runs, and Hypothesis replays choices, so a rule picks "the i-th live
# holder" by index rather than sampling from a list whose length depends on the state.
picks = st.integers(min_value=0, max_value=63)
slots = st.integers(min_value=0, max_value=SLOTS - 1)


def _choose(items: list[T], pick: int) -> T:
    return items[pick % len(items)]


@dataclass
class _Holder:
    state: HolderState
    slot: Slot
    fence: int  # the record's create revision, as the registry reported it


@dataclass
class _Model:
    """What the registry should contain, in plain Python."""

    latest: int = 0
    published: set[int] = field(default_factory=set)  # versions with a manifest
    ever: set[int] = field(default_factory=set)  # every version ever published
    holders: dict[HolderKey, _Holder] = field(default_factory=dict)
    pins: dict[tuple[int, str], Slot] = field(default_factory=dict)
    gone: dict[HolderKey, int] = field(default_factory=dict)  # fences of removed records

    def retained(self) -> list[int]:
        return sorted(self.published)[-RETAIN:]

    def pinned(self) -> set[int]:
        return {version for version, _ in self.pins}

    def drop_holder(self, key: HolderKey) -> None:
        self.gone[key] = self.holders.pop(key).fence

    def publish(self, version: int, holder: str, slot: Slot, fence: int) -> None:
        self.latest = version
        self.published.add(version)
        self.ever.add(version)
        self.holders[(version, holder)] = _Holder(HolderState.COMPLETE, slot, fence)

    def collect(self) -> list[int]:
        """Delete versions older than the newest RETAIN, except pinned ones; return them."""
        if len(self.published) <= RETAIN:
            return []
        oldest_kept = self.retained()[0]
        doomed = sorted(v for v in self.published if v < oldest_kept and v not in self.pinned())
        for version in doomed:
            self.published.discard(version)
            for key in [k for k in self.holders if k[0] == version]:
                self.drop_holder(key)
        return doomed

    def end_session(self, slot: Slot) -> None:
        for key in [k for k, h in self.holders.items() if h.slot == slot]:
            self.drop_holder(key)
        for pin in [p for p, s in self.pins.items() if s == slot]:
            del self.pins[pin]

    def release_blocked(self, key: HolderKey) -> bool:
        """The last-complete-holder rule for a retained version (docs/design.md, "Retention")."""
        mine = self.holders[key]
        version = key[0]
        others = [
            h
            for (v, name), h in self.holders.items()
            if v == version and name != key[1] and h.state is HolderState.COMPLETE
        ]
        return mine.state is HolderState.COMPLETE and version in self.retained() and not others


class RegistryMachine(RuleBasedStateMachine):
    """Drives VersionRegistry and HolderRegistry on a fresh key prefix per example."""

    def __init__(self, etcd: Etcd) -> None:
        super().__init__()
        self.etcd = etcd
        self.keys = Keys(f"/test/stateful-{uuid.uuid4().hex}")
        self.versions = VersionRegistry(etcd, self.keys, retain=RETAIN)
        self.holders = HolderRegistry(self.versions)
        self.model = _Model()
        self.sessions: list[Session] = []
        self.highest_latest_seen = 0

    # -- helpers ---------------------------------------------------------------------------

    def _session(self) -> Session:
        # No keepalive thread: a 60 s lease outlives any example, and expiry is a revoke.
        return Session(self.etcd, ttl=60, keepalive=False)

    def _record(self, holder: str, slot: Slot, state: HolderState) -> HolderRecord:
        return HolderRecord(holder, ENDPOINTS, {"host": holder}, state, self.sessions[slot].id)

    def _candidate_versions(self) -> list[int]:
        """Published, collected and not-yet-published versions, so every branch is reachable."""
        return sorted(self.model.ever | {self.model.latest + 1})

    def _assert_collected_to_model(self) -> None:
        """Right after a collect: exactly the newest RETAIN plus the pinned versions remain."""
        published = sorted(self.model.published)
        expected = sorted(set(published[-RETAIN:]) | (self.model.pinned() & set(published)))
        assert published == expected
        assert self.versions.versions(TENANT, MODEL, timeout=CALL_TIMEOUT) == expected

    # -- set-up and tear-down --------------------------------------------------------------

    @initialize()
    def open_sessions_and_publish(self) -> None:
        """Two sessions and two published versions, so short runs reach the retention rules."""
        self.sessions = [self._session() for _ in range(SLOTS)]
        for version in (1, 2):
            self.publish(delta=1, holder=HOLDERS[0], slot=0)
            assert self.model.latest == version

    def teardown(self) -> None:
        for session in self.sessions:
            session.close(timeout=CALL_TIMEOUT)
        self.etcd.delete(self.keys.prefix + "/", prefix=True, timeout=CALL_TIMEOUT)

    # -- publish ---------------------------------------------------------------------------

    @rule(delta=st.integers(min_value=-2, max_value=3), holder=st.sampled_from(HOLDERS), slot=slots)
    def publish(self, delta: int, holder: str, slot: Slot) -> None:
        version = max(1, self.model.latest + delta)
        record = self._record(holder, slot, HolderState.COMPLETE)
        if version <= self.model.latest:
            event("publish: stale")
            with pytest.raises(StaleVersion):
                self.versions.publish(
                    TENANT, MODEL, version, b"stale", record, timeout=CALL_TIMEOUT
                )
            return  # the invariants check that nothing changed
        published = self.versions.publish(
            TENANT, MODEL, version, f"m{version}".encode(), record, timeout=CALL_TIMEOUT
        )
        assert published.version == version
        assert published.visible
        self.model.publish(version, holder, slot, fence=published.revision)
        collected = self.model.collect()  # publish collects after moving latest
        event(f"publish: collected {len(collected)}, {len(self.model.pinned())} pinned")
        self._assert_collected_to_model()

    @rule(
        holders=st.lists(st.sampled_from(HOLDERS), min_size=2, max_size=2, unique=True),
        slots=st.lists(slots, min_size=2, max_size=2),
    )
    def publish_concurrently(self, holders: list[str], slots: list[Slot]) -> None:
        """Two publishers race for the same next version: one wins, the other is stale."""
        version = self.model.latest + 1
        barrier = threading.Barrier(2)
        outcomes: list[Published | BaseException | None] = [None, None]

        def run(i: int) -> None:
            record = self._record(holders[i], slots[i], HolderState.COMPLETE)
            try:
                barrier.wait(timeout=CALL_TIMEOUT)
                outcomes[i] = self.versions.publish(
                    TENANT, MODEL, version, f"m{version}-{i}".encode(), record,
                    timeout=CALL_TIMEOUT,
                )  # fmt: skip
            except BaseException as exc:  # reported below, in the test's thread
                outcomes[i] = exc

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=3 * CALL_TIMEOUT)
        winners = [i for i, o in enumerate(outcomes) if isinstance(o, Published)]
        losers = [i for i, o in enumerate(outcomes) if isinstance(o, StaleVersion)]
        assert len(winners) == 1, f"expected exactly one winner, got {outcomes}"
        assert len(losers) == 1, f"the loser must get StaleVersion, got {outcomes}"
        (winner,) = winners
        won = outcomes[winner]
        assert isinstance(won, Published)
        assert won.version == version
        assert won.visible
        info = self.versions.describe(TENANT, MODEL, version, timeout=CALL_TIMEOUT)
        assert info.manifest == f"m{version}-{winner}".encode()  # the winner's, not a mix
        self.model.publish(version, holders[winner], slots[winner], fence=won.revision)
        self.model.collect()
        self._assert_collected_to_model()

    # -- holders ---------------------------------------------------------------------------

    @rule(pick=picks, holder=st.sampled_from(HOLDERS), slot=slots)
    def register_partial(self, pick: int, holder: str, slot: Slot) -> None:
        version = _choose(self._candidate_versions(), pick)
        record = self._record(holder, slot, HolderState.PARTIAL)
        if version not in self.model.published:
            event("register: not published")
            with pytest.raises(VersionNotFound):
                self.holders.register(TENANT, MODEL, version, record, timeout=CALL_TIMEOUT)
            return
        fence = self.holders.register(TENANT, MODEL, version, record, timeout=CALL_TIMEOUT)
        key = (version, holder)
        previous = self.model.holders.get(key)
        if previous is not None:
            # Re-registering overwrites the record in place: same key, same create revision.
            assert fence == previous.fence
        else:
            assert fence > self.model.gone.get(key, 0)  # a new incarnation, a new token
        self.model.holders[key] = _Holder(HolderState.PARTIAL, slot, fence)
        # A PARTIAL record pins its version under the same lease (retention needs no Pin).
        self.model.pins[(version, holder)] = slot

    @rule(pick=picks)
    def mark_complete(self, pick: int) -> None:
        if not self.model.holders:
            return
        key = _choose(sorted(self.model.holders), pick)
        held = self.model.holders[key]
        record = self._record(key[1], held.slot, HolderState.COMPLETE)
        self.holders.update_state(TENANT, MODEL, key[0], record, held.fence, timeout=CALL_TIMEOUT)
        held.state = HolderState.COMPLETE
        self.model.pins.pop(key, None)  # COMPLETE drops the pin its PARTIAL record took

    @rule(pick=picks, slot=slots)
    def update_with_stale_fence(self, pick: int, slot: Slot) -> None:
        """A holder whose record is gone (or was recreated) cannot write with its old token:
        `VersionRetired` if retention took its version, else `LeaseLost`."""
        if not self.model.gone:
            return
        key = _choose(sorted(self.model.gone), pick)
        record = self._record(key[1], slot, HolderState.COMPLETE)
        retired = key[0] not in self.model.published
        event(f"update: stale fence, version {'retired' if retired else 'kept'}")
        with pytest.raises(VersionRetired if retired else LeaseLost) as info:
            self.holders.update_state(
                TENANT, MODEL, key[0], record, self.model.gone[key], timeout=CALL_TIMEOUT
            )
        assert isinstance(info.value, VersionRetired) == retired

    @rule(pick=picks, force=st.booleans())
    def release(self, pick: int, force: bool) -> None:
        """Release a live record (mostly), or any (version, holder), which may not exist."""
        if pick % 4 and self.model.holders:
            version, holder = _choose(sorted(self.model.holders), pick)
        else:
            pairs = [(v, h) for v in self._candidate_versions() for h in HOLDERS]
            version, holder = _choose(pairs, pick)
        key = (version, holder)

        def call() -> None:
            self.holders.release(TENANT, MODEL, version, holder, force=force, timeout=CALL_TIMEOUT)

        if key not in self.model.holders:
            event("release: no such record")
            call()  # nothing to release: not an error, and nothing changes
        elif not force and self.model.release_blocked(key):
            event("release: last complete holder of a retained version")
            with pytest.raises(RetentionViolation):
                call()
        else:
            event("release: forced" if force else "release: allowed")
            call()
            self.model.drop_holder(key)
            self.model.pins.pop(key, None)  # and the pin of a PARTIAL record with it

    # -- leases ----------------------------------------------------------------------------

    @rule(slot=slots)
    def expire_session(self, slot: Slot) -> None:
        """The lease ends (revoked: expiry made immediate); its records and pins vanish."""
        session = self.sessions[slot]
        session.orphan()
        self.etcd.lease_revoke(session.id, timeout=CALL_TIMEOUT)
        self.model.end_session(slot)
        self.sessions[slot] = self._session()

    # -- retention -------------------------------------------------------------------------

    @rule(pick=picks, pin_id=st.sampled_from(PINS), slot=slots)
    def pin(self, pick: int, pin_id: str, slot: Slot) -> None:
        # Mostly the oldest published version: the one the next publish would collect.
        published = sorted(self.model.published)
        version = (
            published[0] if pick % 4 and published else _choose(self._candidate_versions(), pick)
        )
        session = self.sessions[slot].id
        if version not in self.model.published:
            with pytest.raises(VersionNotFound):
                self.holders.pin(TENANT, MODEL, version, pin_id, session, timeout=CALL_TIMEOUT)
            return
        self.holders.pin(TENANT, MODEL, version, pin_id, session, timeout=CALL_TIMEOUT)
        self.model.pins[(version, pin_id)] = slot

    @rule(pick=picks)
    def unpin(self, pick: int) -> None:
        if not self.model.pins:
            return
        version, pin_id = _choose(sorted(self.model.pins), pick)
        self.holders.unpin(TENANT, MODEL, version, pin_id, timeout=CALL_TIMEOUT)
        del self.model.pins[(version, pin_id)]

    @rule()
    def collect(self) -> None:
        expected = self.model.collect()
        event(f"collect: {len(expected)} deleted, {len(self.model.pinned())} pinned")
        assert self.versions.collect(TENANT, MODEL, timeout=CALL_TIMEOUT) == expected
        self._assert_collected_to_model()

    # -- invariants ------------------------------------------------------------------------

    @invariant()
    def latest_matches_and_never_decreases(self) -> None:
        latest, _ = self.versions.latest(TENANT, MODEL, timeout=CALL_TIMEOUT)
        assert latest == self.model.latest
        assert latest >= self.highest_latest_seen
        self.highest_latest_seen = latest

    @invariant()
    def versions_match(self) -> None:
        assert self.versions.versions(TENANT, MODEL, timeout=CALL_TIMEOUT) == sorted(
            self.model.published
        )
        assert self.versions.retained(TENANT, MODEL, timeout=CALL_TIMEOUT) == (
            self.model.retained()
        )

    @invariant()
    def live_holders_match(self) -> None:
        for version in sorted(self.model.published):
            found, _ = self.holders.list(TENANT, MODEL, version, timeout=CALL_TIMEOUT)
            actual = {(h.holder, h.state, h.session, h.revision) for h in found}
            expected = {
                (name, h.state, self.sessions[h.slot].id, h.fence)
                for (v, name), h in self.model.holders.items()
                if v == version
            }
            assert actual == expected, f"holders of v{version}"

    @invariant()
    def nothing_outside_the_model(self) -> None:
        """No key of a collected version, holder or pin survives that the model does not have."""
        base = self.keys.versions(TENANT, MODEL)
        result = self.etcd.range(base, prefix=True, keys_only=True, timeout=CALL_TIMEOUT)
        actual: set[tuple[int, str, str]] = set()
        for kv in result.kvs:
            actual.add(self.keys.parse_version_key(TENANT, MODEL, kv.key.decode()))
        expected = {(v, "manifest", "") for v in self.model.published}
        expected |= {(v, "h", name) for v, name in self.model.holders}
        expected |= {(v, "pin", pin_id) for v, pin_id in self.model.pins}
        assert actual == expected


@pytest.mark.timeout(120)
def test_registry_matches_model(etcd_cluster: EtcdCluster) -> None:
    with Etcd(etcd_cluster.endpoints, timeout=CALL_TIMEOUT) as etcd:

        class OnThisEtcd(RegistryMachine):
            def __init__(self) -> None:
                super().__init__(etcd)

        run_state_machine_as_test(
            OnThisEtcd,
            settings=settings(max_examples=15, stateful_step_count=12, deadline=None),
        )


@pytest.mark.timeout(30)
def test_real_lease_expiry_matches_the_model(
    etcd: Etcd, versions: VersionRegistry, holders: HolderRegistry
) -> None:
    """What the machine does with a revoke, a real 1 s TTL does by itself (within TTL + 4 s)."""
    with Session(etcd, ttl=30) as trainer:
        record = HolderRecord("trainer", ENDPOINTS, session=trainer.id)
        versions.publish(TENANT, MODEL, 1, b"m1", record)
        reader = Session(etcd, ttl=1)
        reader_record = HolderRecord("reader", ENDPOINTS, session=reader.id)
        fence = holders.register(TENANT, MODEL, 1, reader_record)
        holders.pin(TENANT, MODEL, 1, "reader-pin", reader.id)
        holders.update_state(
            TENANT, MODEL, 1, reader_record.with_state(HolderState.COMPLETE), fence
        )
        reader.orphan()  # a crash: no revoke, the TTL has to run out
        started = time.monotonic()

        key = versions.keys.holder(TENANT, MODEL, 1, "reader")
        with KeyWatch(etcd, key, prefix=False, start_revision=fence + 1) as watch:
            while True:
                remaining = started + 5.0 - time.monotonic()
                assert remaining > 0, "the 1 s lease did not expire within 5 s"
                event = watch.get(remaining)
                if event is not None and getattr(event, "deleted", False):
                    break

        live, _ = holders.list(TENANT, MODEL, 1)
        assert [h.holder for h in live] == ["trainer"]
        assert versions.describe(TENANT, MODEL, 1).pins == []
        with pytest.raises(LeaseLost):  # the old token is dead
            holders.update_state(TENANT, MODEL, 1, reader_record, fence)
        with pytest.raises(LeaseLost):  # and the session cannot be adopted again
            Session(etcd, lease_id=reader.id)
        # The trainer is again the last complete holder of a retained version.
        with pytest.raises(RetentionViolation):
            holders.release(TENANT, MODEL, 1, "trainer")
