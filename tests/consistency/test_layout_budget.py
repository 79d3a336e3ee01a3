"""Layout block sets in the tenant's etcd budget, over a real etcd (`consistency/layouts.py`,
`consistency/usage.py`): the registration that creates a block set's key charges its bytes in
its own transaction, or is refused with nothing written; retention and model deletion give
the charge back in the transaction that deletes the keys; a version records at most
`MAX_LAYOUTS_PER_VERSION` layouts; racing registrations charge each key exactly once."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

import consistency.layouts as layouts_module
from consistency import Etcd, HolderRecord, HolderState, Keys, Session, VersionRegistry
from consistency.deletion import delete_model
from consistency.layout_records import BlockSetKey, encode_block_set
from consistency.layouts import LayoutRegistry
from consistency.usage import RECORD_BYTES, TenantBudget, Usage
from tensorhub.errors import QuotaExceeded

BLOCKS = b'{"blocks": "described"}'


def rec(session: Session, name: str) -> HolderRecord:
    return HolderRecord(
        name, {"tcp": "127.0.0.1:9"}, {"host": name}, HolderState.COMPLETE, session.id
    )


def charge_of(sums: list[int]) -> int:
    return len(encode_block_set(BLOCKS, sums)) + RECORD_BYTES


@pytest.fixture
def session(etcd: Etcd, keys: Keys) -> Iterator[Session]:
    with Session(etcd, ttl=10) as s:
        etcd.put(keys.session("t", s.id), b"", lease=s.id)
        yield s


@pytest.fixture
def versions(etcd: Etcd, keys: Keys, session: Session) -> VersionRegistry:
    registry = VersionRegistry(etcd, keys, retain=1)
    registry.publish("t", "m", 1, b"manifest", rec(session, "trainer"))
    return registry


def registry_with(etcd: Etcd, keys: Keys, max_bytes: int) -> LayoutRegistry:
    budget = TenantBudget(
        etcd, keys, "t", max_bytes=max_bytes, publishes_per_minute=60, history_bytes=1 << 30
    )
    return LayoutRegistry(etcd, keys, budget)


def held(etcd: Etcd, keys: Keys) -> int:
    kv, _ = etcd.get(keys.quota_fence("t", "usage"))
    return 0 if kv is None else Usage.decode(kv.value).held


def keys_under(etcd: Etcd, prefix: str) -> list[str]:
    return [bytes(kv.key).decode() for kv in etcd.range(prefix, prefix=True, keys_only=True).kvs]


def test_a_block_set_is_charged_once_and_given_back_when_its_version_is_retired(
    etcd: Etcd, keys: Keys, session: Session, versions: VersionRegistry
) -> None:
    registry = registry_with(etcd, keys, 1 << 20)
    mark = keys.session("t", session.id)
    at = BlockSetKey("t", "m", 1, "tp2", "set0")
    registry.register(at, rec(session, "a"), [1, 2, 3], session_key=mark, blocks=BLOCKS)
    assert held(etcd, keys) == charge_of([1, 2, 3])
    registry.register(at, rec(session, "b"), [1, 2, 3], session_key=mark, blocks=BLOCKS)
    registry.register(at, rec(session, "c"), [], session_key=mark)  # PARTIAL: records none
    assert held(etcd, keys) == charge_of([1, 2, 3])  # another holder: no second charge
    other = BlockSetKey("t", "m", 1, "tp1", "set9")
    registry.register(other, rec(session, "d"), [4], session_key=mark, blocks=BLOCKS)
    assert held(etcd, keys) == charge_of([1, 2, 3]) + charge_of([4])

    versions.publish("t", "m", 2, b"manifest", rec(session, "trainer"))
    versions.collect("t", "m")  # (the publish may have collected it already)
    assert versions.versions("t", "m") == [2]
    assert held(etcd, keys) == 0
    assert keys_under(etcd, keys.model_layouts("t", "m")) == []


def test_a_model_deletion_gives_its_block_sets_charge_back(
    etcd: Etcd, keys: Keys, session: Session, versions: VersionRegistry
) -> None:
    registry = registry_with(etcd, keys, 1 << 20)
    mark = keys.session("t", session.id)
    versions.retain = 2
    versions.publish("t", "m", 2, b"manifest", rec(session, "trainer"))
    for version in (1, 2):
        at = BlockSetKey("t", "m", version, "tp2", "set0")
        registry.register(at, rec(session, "a"), [version], session_key=mark, blocks=BLOCKS)
    assert held(etcd, keys) == 2 * charge_of([1])
    delete_model(etcd, keys, "t", "m")
    assert held(etcd, keys) == 0
    assert keys_under(etcd, keys.model_layouts("t", "m")) == []


def test_a_block_set_past_the_budget_is_refused_with_nothing_written(
    etcd: Etcd, keys: Keys, session: Session, versions: VersionRegistry
) -> None:
    mark = keys.session("t", session.id)
    fits = charge_of([1])
    registry = registry_with(etcd, keys, fits + charge_of([1, 2]) - 1)
    registry.register(
        BlockSetKey("t", "m", 1, "tp2", "set0"), rec(session, "a"), [1], session_key=mark,
        blocks=BLOCKS,
    )  # fmt: skip
    before = sorted(keys_under(etcd, keys.model_layouts("t", "m")))
    at = BlockSetKey("t", "m", 1, "tp2", "set1")
    with pytest.raises(QuotaExceeded, match="max_etcd_bytes"):
        registry.register(at, rec(session, "b"), [1, 2], session_key=mark, blocks=BLOCKS)
    assert sorted(keys_under(etcd, keys.model_layouts("t", "m"))) == before  # no holder key
    assert held(etcd, keys) == fits
    assert registry.resolve(at).holders == []
    # One that fits still does, and another holder of a recorded block set costs nothing.
    registry.register(at, rec(session, "b"), [], session_key=mark)  # PARTIAL: no charge
    registry.register(
        BlockSetKey("t", "m", 1, "tp2", "set0"), rec(session, "c"), [1], session_key=mark,
        blocks=BLOCKS,
    )  # fmt: skip
    assert held(etcd, keys) == fits


def test_a_block_set_past_the_history_budget_is_refused(
    etcd: Etcd, keys: Keys, session: Session, versions: VersionRegistry
) -> None:
    """Its key is written into etcd's history as well: the history bucket is charged too."""
    budget = TenantBudget(
        etcd, keys, "t", max_bytes=1 << 20, publishes_per_minute=60,
        history_bytes=charge_of([1]) + 10,
    )  # fmt: skip
    registry = LayoutRegistry(etcd, keys, budget)
    mark = keys.session("t", session.id)
    registry.register(
        BlockSetKey("t", "m", 1, "tp2", "set0"), rec(session, "a"), [1], session_key=mark,
        blocks=BLOCKS,
    )  # fmt: skip
    with pytest.raises(QuotaExceeded, match="max_history_bytes"):
        registry.register(
            BlockSetKey("t", "m", 1, "tp2", "set1"), rec(session, "b"), [1], session_key=mark,
            blocks=BLOCKS,
        )  # fmt: skip
    assert held(etcd, keys) == charge_of([1])


def test_a_layout_past_the_versions_bound_is_refused_with_nothing_written(
    etcd: Etcd,
    keys: Keys,
    session: Session,
    versions: VersionRegistry,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(layouts_module, "MAX_LAYOUTS_PER_VERSION", 2)
    registry = registry_with(etcd, keys, 1 << 20)
    mark = keys.session("t", session.id)
    for layout in ("tp1", "tp2"):
        at = BlockSetKey("t", "m", 1, layout, "set0")
        registry.register(at, rec(session, layout), [1], session_key=mark, blocks=BLOCKS)
    charged = held(etcd, keys)
    third = BlockSetKey("t", "m", 1, "tp4", "set0")
    with pytest.raises(QuotaExceeded, match="2 layouts"):
        registry.register(third, rec(session, "x"), [1], session_key=mark, blocks=BLOCKS)
    assert keys_under(etcd, keys.layout("t", "m", 1, "tp4")) == []
    assert held(etcd, keys) == charged
    # A new block set of a recorded layout is no new layout; another version has its own.
    at = BlockSetKey("t", "m", 1, "tp2", "set1")
    registry.register(at, rec(session, "y"), [1], session_key=mark, blocks=BLOCKS)
    versions.retain = 2
    versions.publish("t", "m", 2, b"manifest", rec(session, "trainer"))
    at = BlockSetKey("t", "m", 2, "tp4", "set0")
    registry.register(at, rec(session, "z"), [1], session_key=mark, blocks=BLOCKS)


def test_racing_registrations_charge_each_block_set_exactly_once(
    etcd: Etcd, keys: Keys, session: Session, versions: VersionRegistry
) -> None:
    """Readers of one block set and of different ones register at once (each on its own
    registry, as on different replicas): each key is charged once, whoever created it."""
    mark = keys.session("t", session.id)
    sets = 4
    errors: list[BaseException] = []

    def reader(i: int) -> None:
        registry = registry_with(etcd, keys, 1 << 20)
        at = BlockSetKey("t", "m", 1, "tp2", f"set{i % sets}")
        try:
            registry.register(at, rec(session, f"h{i}"), [i % sets], session_key=mark,
                              blocks=BLOCKS)  # fmt: skip
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(3 * sets)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors
    assert held(etcd, keys) == sets * charge_of([0])
    registry = registry_with(etcd, keys, 1 << 20)
    found, _ = registry.cover("t", "m", 1, "tp2")
    assert sorted(s.block_set for s in found) == [f"set{b}" for b in range(sets)]
    assert all(len(registry.resolve(BlockSetKey("t", "m", 1, "tp2", s.block_set)).holders) == 3
               for s in found)  # fmt: skip
