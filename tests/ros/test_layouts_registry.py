"""The layout holder registry over a real etcd (`consistency/layouts.py`): a Resolve of a
block set is bounded whatever the number of its holders, the checksums are recorded once,
a release is its owner's, a PARTIAL holder pins its version, and nothing is registered
for a version that is not published or under a lease that is no session of the tenant."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest

import consistency.layouts as layouts_module
from consistency import Etcd, HolderRecord, HolderState, Keys, Session, VersionRegistry
from consistency.layout_limits import COVER_HOLDERS_EACH, MAX_LAYOUT_HOLDERS_READ
from consistency.layout_records import BlockSetKey
from consistency.layouts import LayoutRegistry, layout_pin_id
from ros.hub.rpc_layouts import MAX_LAYOUT_CANDIDATES, _nearest
from tensorhub.errors import PermissionDenied, QuotaExceeded, SessionExpired, VersionNotFound

AT = BlockSetKey("t", "m", 1, "tp2", "0123abcd")


def rec(session: Session, name: str) -> HolderRecord:
    return HolderRecord(
        name, {"tcp": "127.0.0.1:9"}, {"host": name}, HolderState.COMPLETE, session.id
    )


@pytest.fixture
def session(etcd: Etcd, keys: Keys) -> Iterator[Session]:
    """A live session of tenant `t` (its mark put under its lease, as OpenSession does)."""
    with Session(etcd, ttl=10) as s:
        etcd.put(keys.session("t", s.id), b"", lease=s.id)
        yield s


@pytest.fixture
def registry(etcd: Etcd, keys: Keys, session: Session) -> LayoutRegistry:
    VersionRegistry(etcd, keys).publish("t", "m", 1, b"manifest", rec(session, "trainer"))
    return LayoutRegistry(etcd, keys)


def test_the_first_checksums_are_recorded_and_later_ones_are_answered_with_them(
    registry: LayoutRegistry, keys: Keys, session: Session
) -> None:
    mark = keys.session("t", session.id)
    _, _, first = registry.register(AT, rec(session, "a"), [1, 2, 3], session_key=mark)
    _, _, second = registry.register(AT, rec(session, "b"), [9, 9, 9], session_key=mark)
    assert first == [1, 2, 3]
    assert second == [1, 2, 3]
    assert registry.resolve(AT).sums == [1, 2, 3]


def test_a_resolve_reads_a_bounded_range_however_many_holders(
    registry: LayoutRegistry, keys: Keys, session: Session
) -> None:
    mark = keys.session("t", session.id)
    for i in range(MAX_LAYOUT_HOLDERS_READ + 16):
        registry.register(AT, rec(session, f"h{i:03d}"), [7], session_key=mark)
    found = registry.resolve(AT)
    assert len(found.holders) == MAX_LAYOUT_HOLDERS_READ
    assert found.sums == [7]


def test_a_release_is_the_owning_sessions_and_the_lease_takes_the_rest(
    etcd: Etcd, registry: LayoutRegistry, keys: Keys, session: Session
) -> None:
    mark = keys.session("t", session.id)
    registry.register(AT, rec(session, "a"), [1], session_key=mark)
    with Session(etcd, ttl=10) as other:
        etcd.put(keys.session("t", other.id), b"", lease=other.id)
        registry.register(AT, rec(other, "b"), [1], session_key=keys.session("t", other.id))
        with pytest.raises(PermissionDenied):
            registry.release(AT, "a", other.id)
        registry.release(AT, "a", session.id)
        registry.release(AT, "a", session.id)  # gone already: done
        assert [h.holder for h in registry.resolve(AT).holders] == ["b"]
    assert registry.resolve(AT).holders == []  # its session closed: its lease took "b"


def test_nothing_is_registered_for_an_unpublished_version_or_a_foreign_lease(
    etcd: Etcd, registry: LayoutRegistry, keys: Keys, session: Session
) -> None:
    mark = keys.session("t", session.id)
    with pytest.raises(VersionNotFound):
        registry.register(
            BlockSetKey("t", "m", 2, "tp2", "0123abcd"), rec(session, "a"), [1], session_key=mark
        )
    with Session(etcd, ttl=10) as stranger, pytest.raises(SessionExpired):  # no tenant mark
        registry.register(AT, rec(stranger, "a"), [1], session_key=keys.session("t", stranger.id))
    with pytest.raises(VersionNotFound):
        registry.resolve(BlockSetKey("t", "m", 2, "tp2", "0123abcd"))
    assert registry.resolve(AT).holders == []


def test_the_hub_answers_the_nearest_few_holders_never_the_caller(session: Session) -> None:
    far = [
        HolderRecord(
            f"far{i}",
            {"tcp": "127.0.0.1:9"},
            {"host": f"x{i}"},
            HolderState.COMPLETE,
            session.id,
            revision=i,
        )
        for i in range(MAX_LAYOUT_CANDIDATES + 4)
    ]
    rack = HolderRecord(
        "rack",
        {"tcp": "127.0.0.1:9"},
        {"host": "y", "rack": "r1"},
        HolderState.COMPLETE,
        session.id,
        revision=99,
    )
    me = HolderRecord(
        "me",
        {"tcp": "127.0.0.1:9"},
        {"host": "z", "rack": "r1"},
        HolderState.COMPLETE,
        session.id,
        revision=0,
    )
    chosen = _nearest([*far, rack, me], {"host": "z", "rack": "r1"}, "me")
    assert [r.holder for r in chosen] == [
        "rack",
        *(f"far{i}" for i in range(MAX_LAYOUT_CANDIDATES - 1)),
    ]


def test_a_cover_lists_a_layouts_block_sets_with_a_few_holders_each(
    registry: LayoutRegistry, keys: Keys, session: Session
) -> None:
    mark = keys.session("t", session.id)
    for b in range(3):
        at = BlockSetKey("t", "m", 1, "tp2", f"set{b}")
        for i in range(COVER_HOLDERS_EACH + 3):
            registry.register(at, rec(session, f"h{b}-{i}"), [b], session_key=mark, blocks=b"{}")
    found, _ = registry.cover("t", "m", 1, "tp2")
    assert [(s.block_set, s.sums, s.blocks) for s in found] == [
        (f"set{b}", [b], b"{}") for b in range(3)
    ]
    assert all(len(s.holders) == COVER_HOLDERS_EACH for s in found)
    assert registry.cover("t", "m", 1, "tp4")[0] == []  # a layout nobody declared


def test_a_cover_names_complete_holders_however_many_partial_ones_sort_first(
    etcd: Etcd, registry: LayoutRegistry, keys: Keys, session: Session
) -> None:
    """More PARTIAL holders than a cover lists, all sorting before the COMPLETE ones (in key
    order, which is name order, and registered before them): the cover names the COMPLETE
    ones, a PARTIAL registration again unlists a holder, and a release or the lease's end
    takes a holder out of the cover with its record."""
    mark = keys.session("t", session.id)
    partials = [f"a{i:02d}" for i in range(COVER_HOLDERS_EACH + 2)]
    for name in partials:
        partial = replace(rec(session, name), state=HolderState.PARTIAL)
        registry.register_partial(AT, partial, session_key=mark)
    registry.register(AT, rec(session, "y"), [5], session_key=mark, blocks=b"{}")
    registry.register_partial(AT, replace(rec(session, "z"), state=HolderState.PARTIAL),
                              session_key=mark)  # fmt: skip
    registry.register(AT, rec(session, "z"), [5], session_key=mark)  # PARTIAL, then COMPLETE
    assert [h.holder for h in registry.resolve(AT).holders][:COVER_HOLDERS_EACH] == partials[
        :COVER_HOLDERS_EACH
    ]  # what a range of the holder keys would have offered: no COMPLETE one
    (found,), _ = registry.cover("t", "m", 1, "tp2")
    assert [(h.holder, h.complete) for h in found.holders] == [("y", True), ("z", True)]
    registry.register_partial(AT, replace(rec(session, "y"), state=HolderState.PARTIAL),
                              session_key=mark)  # fmt: skip
    assert [h.holder for h in registry.cover("t", "m", 1, "tp2")[0][0].holders] == ["z"]
    registry.release(AT, "z", session.id)
    assert registry.cover("t", "m", 1, "tp2")[0][0].holders == []
    with Session(etcd, ttl=10) as other:
        etcd.put(keys.session("t", other.id), b"", lease=other.id)
        registry.register(AT, rec(other, "x"), [5], session_key=keys.session("t", other.id))
        assert [h.holder for h in registry.cover("t", "m", 1, "tp2")[0][0].holders] == ["x"]
    assert registry.cover("t", "m", 1, "tp2")[0][0].holders == []  # its lease took both keys
    assert etcd.range(keys.layout("t", "m", 1, "tp2") + "c/", prefix=True).kvs == []


def test_a_block_set_past_the_layouts_bound_is_refused_with_nothing_written(
    registry: LayoutRegistry, keys: Keys, session: Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(layouts_module, "MAX_BLOCK_SETS_PER_LAYOUT", 2)
    mark = keys.session("t", session.id)
    for b in range(2):
        at = BlockSetKey("t", "m", 1, "tp2", f"set{b}")
        registry.register(at, rec(session, f"h{b}"), [b], session_key=mark)
    third = BlockSetKey("t", "m", 1, "tp2", "set2")
    with pytest.raises(QuotaExceeded):
        registry.register(third, rec(session, "h2"), [2], session_key=mark)
    assert [s.block_set for s in registry.cover("t", "m", 1, "tp2")[0]] == ["set0", "set1"]
    assert registry.resolve(third).holders == []
    registry.register(  # a new holder of a recorded block set is no new block set
        BlockSetKey("t", "m", 1, "tp2", "set0"), rec(session, "h3"), [0], session_key=mark
    )


def test_a_partial_holder_pins_its_version_until_it_completes_or_releases(
    etcd: Etcd, registry: LayoutRegistry, keys: Keys, session: Session
) -> None:
    """The PARTIAL registration pins the version in its own transaction (so a reader in a
    layout calls no Pin): retention keeps it while the reader fills its blocks, and the
    COMPLETE registration or the release drops the pin, after which it is collected."""
    mark = keys.session("t", session.id)
    versions = VersionRegistry(etcd, keys, retain=1)

    def pins() -> dict[str, int]:
        found = etcd.range(keys.pins("t", "m", 1), prefix=True)
        return {bytes(kv.key).decode().rsplit("/", 1)[1]: int(kv.lease) for kv in found.kvs}

    partial = replace(rec(session, "a"), state=HolderState.PARTIAL)
    fence, found = registry.register_partial(AT, partial, session_key=mark)
    assert pins() == {layout_pin_id("a"): session.id}  # on the holder's lease
    assert [(h.holder, h.revision) for h in found.holders] == [("a", fence)]
    versions.publish("t", "m", 2, b"manifest", rec(session, "trainer"))
    assert versions.collect("t", "m") == []  # pinned by the reader of its blocks
    registry.register(AT, rec(session, "a"), [1], session_key=mark)  # COMPLETE
    assert pins() == {}
    registry.register_partial(AT, replace(partial, holder="b"), session_key=mark)
    assert set(pins()) == {layout_pin_id("b")}
    registry.release(AT, "b", session.id)
    assert pins() == {}
    assert versions.collect("t", "m") == [1]
