"""`consistency.parts_sums.PartsSums`: the publisher checksums a hub added up from a
version's parts, kept per version incarnation within a bound, added up by one caller at a
time (the other resolves of that version wait for its sums rather than read the parts)."""

from __future__ import annotations

import threading

import pytest

from consistency.parts_sums import PartsSums
from tensorhub.errors import DeadlineExceeded

SUMS = {("tp1", "a" * 32): [1, 2, 3]}


def test_callers_of_one_version_wait_for_the_one_that_adds_its_sums_up() -> None:
    kept = PartsSums()
    go = threading.Event()
    calls: list[int] = []

    def add() -> dict[tuple[str, str], list[int]]:
        calls.append(1)
        go.wait(10)
        return SUMS

    key = ("t", "m", 2, 7)
    got: list[object] = []
    threads = [
        threading.Thread(target=lambda: got.append(kept.get_or_add(key, add))) for _ in range(5)
    ]
    for thread in threads:
        thread.start()
    go.set()
    for thread in threads:
        thread.join(10)
    assert len(calls) == 1
    assert [{at: list(v) for at, v in g.items()} for g in got] == [SUMS] * 5  # type: ignore[attr-defined]


def test_a_caller_waits_for_another_adding_up_only_within_its_timeout() -> None:
    kept = PartsSums()
    adding, go = threading.Event(), threading.Event()

    def add() -> dict[tuple[str, str], list[int]]:
        adding.set()
        go.wait(10)
        return SUMS

    key = ("t", "m", 2, 7)
    first = threading.Thread(target=kept.get_or_add, args=(key, add))
    first.start()
    assert adding.wait(10)
    with pytest.raises(DeadlineExceeded, match="m@2"):
        kept.get_or_add(key, add, timeout=0.05)
    go.set()
    first.join(10)
    assert {at: list(v) for at, v in kept.get_or_add(key, add, timeout=0.05).items()} == SUMS


def test_sums_are_kept_within_the_bound_least_recently_used_first_out() -> None:
    kept = PartsSums(max_sums=2 * 1024 + 6)  # two versions of 3 sums (each weighs 1,027)
    for version in (1, 2, 3):
        kept.get_or_add(("t", "m", version, 1), lambda: SUMS)
    assert len(kept) == 2
    calls: list[int] = []

    def add() -> dict[tuple[str, str], list[int]]:
        calls.append(1)
        return SUMS

    kept.get_or_add(("t", "m", 3, 1), add)  # kept
    kept.get_or_add(("t", "m", 1, 1), add)  # dropped first: added up again
    assert len(calls) == 1
    kept.get_or_add(("t", "m", 1, 2), add)  # another incarnation of version 1
    assert len(calls) == 2
    big = PartsSums(max_sums=1024 + 2)  # a version over the whole bound is not kept
    big.get_or_add(("t", "m", 1, 1), lambda: SUMS)
    assert len(big) == 0
