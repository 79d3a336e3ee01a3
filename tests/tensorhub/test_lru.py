"""`tensorhub.lru.SizedLru`: the bound both manifest caches (hub and SDK) rely on."""

from __future__ import annotations

from tensorhub.lru import SizedLru


def test_least_recently_used_go_first_within_the_size_bound() -> None:
    lru: SizedLru[str, bytes] = SizedLru(10, len)
    lru.put("a", b"aaaa")
    lru.put("b", b"bbbb")
    assert lru.get("a") == b"aaaa"  # now "b" is the least recently used
    lru.put("c", b"cccc")
    assert lru.get("b") is None
    assert lru.get("a") == b"aaaa"
    assert lru.get("c") == b"cccc"
    assert lru.used == 8


def test_a_value_larger_than_the_bound_is_not_kept_and_replacing_counts_once() -> None:
    lru: SizedLru[str, bytes] = SizedLru(4, len)
    lru.put("big", b"12345")
    assert lru.get("big") is None
    assert len(lru) == 0
    lru.put("k", b"12")
    lru.put("k", b"123")
    assert lru.used == 3
    lru.pop("k")
    lru.pop("missing")
    assert (len(lru), lru.used) == (0, 0)
