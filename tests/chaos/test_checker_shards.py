"""The checker on hand-built histories of model-parallel versions: a version visible with a
shard missing, a shard read with other bytes than its rank's, a refused retry of a shard
publish, a stale or lost shard are reported with the operations that prove them; a version
whose rank died and that never became visible is not."""

from __future__ import annotations

import itertools
from typing import Any

from chaos.checker import Facts, FaultWindow, Violation, check
from chaos.history import FAIL, INFO, MP_MODEL, OK, Op

_ids = itertools.count(1)


def op(
    client: str, f: str, t0: float, t1: float | None, outcome: str = OK, timeout: float = 5.0,
    error: str = "", args: dict[str, Any] | None = None, **value: Any,
) -> Op:  # fmt: skip
    args = {"model": MP_MODEL, **(args or {})}
    return Op(next(_ids), client, f, t0, timeout, args, outcome, t1, value, error)


def shard_pub(
    shard: int, version: int, t0: float, t1: float | None, outcome: str = OK, *,
    shards: int = 2, visible: bool = False, gen: int = 1, error: str = "",
) -> Op:  # fmt: skip
    args = {"version": version, "shard": shard, "shards": shards, "hash": f"h{version}.{shard}"}
    value = {"version": version, "revision": version * 10, "visible": visible}
    return op(f"rank-{shard}#{gen}", "publish-shard", t0, t1, outcome, 10.0, error, args,
              **(value if outcome == OK else {}))  # fmt: skip


def burst(version: int, t: float, shards: int = 2) -> list[Op]:
    """Every rank publishes its shard of `version`; the last one makes it visible."""
    last = shards - 1
    return [
        shard_pub(i, version, t + 0.01 * i, t + 0.1 + 0.01 * i, shards=shards, visible=i == last)
        for i in range(shards)
    ]


def latest(t0: float, t1: float, version: int, revision: int, client: str = "sr#1") -> Op:
    return op(client, "latest", t0, t1, version=version, revision=revision)


def fetch_shard(version: int, shard: int, t0: float, t1: float, content: str = "",
                error: str = "") -> Op:  # fmt: skip
    args = {"version": version, "shard": shard}
    if error:
        return op("sr#1", "fetch-shard", t0, t1, FAIL, 20.0, error, args)
    return op("sr#1", "fetch-shard", t0, t1, args=args, version=version, shard=shard,
              hash=content or f"h{version}.{shard}")  # fmt: skip


def inspect(version: int, t0: float, t1: float, count: int = 2, manifests: int = 2) -> Op:
    return op("sr#1", "inspect-shards", t0, t1, args={"version": version}, version=version,
              shard_count=count, manifests=manifests, revision=version * 10)  # fmt: skip


def kinds(violations: list[Violation]) -> list[str]:
    return [v.kind for v in violations]


def test_a_whole_version_read_back_with_its_ranks_bytes_has_no_violation() -> None:
    ops = [
        *burst(1, 0.0),
        latest(0.3, 0.35, 1, 11),
        inspect(1, 0.4, 0.45),
        fetch_shard(1, 0, 0.5, 0.6),
        fetch_shard(1, 1, 0.7, 0.8),
    ]
    assert check(Facts(ops)) == []


def test_a_version_visible_while_a_shard_was_never_published_is_partial() -> None:
    only_rank_0 = shard_pub(0, 1, 0.0, 0.1, visible=True)
    seen = latest(0.3, 0.35, 1, 11)
    found = check(Facts([only_rank_0, seen, fetch_shard(1, 0, 0.5, 0.6)]))
    assert kinds(found) == ["partial-version"]
    assert found[0].invariant == 1
    assert found[0].ops[0] is only_rank_0  # the first to see it visible: its own publish
    assert "shard(s) [1] of its 2" in found[0].message


def test_a_shard_publish_that_definitely_failed_cannot_explain_a_visible_version() -> None:
    refused = shard_pub(1, 1, 0.0, 0.1, FAIL, error="InvalidArgument: count")
    ops = [shard_pub(0, 1, 0.0, 0.1), refused, latest(0.3, 0.35, 1, 11)]
    found = check(Facts(ops))
    assert kinds(found) == ["partial-version"]
    assert refused in found[0].ops


def test_a_visible_version_seen_before_its_last_shard_was_even_sent_is_partial() -> None:
    ops = [shard_pub(0, 1, 0.0, 0.1), latest(0.3, 0.35, 1, 11), shard_pub(1, 1, 0.5, 0.6)]
    assert kinds(check(Facts(ops))) == ["partial-version"]


def test_an_inspection_that_answers_fewer_manifests_than_shards_is_partial() -> None:
    found = check(Facts([*burst(1, 0.0), inspect(1, 0.4, 0.45, count=2, manifests=1)]))
    assert kinds(found) == ["partial-version"]
    assert "1 manifests" in found[0].message


def test_a_read_refused_for_missing_shard_records_is_partial() -> None:
    failed = fetch_shard(1, 1, 0.5, 0.6, error="VersionNotFound: policy-mp@1 has inconsistent "
                         "shard records")  # fmt: skip
    found = check(Facts([*burst(1, 0.0), failed]))
    # its ranks are healthy holders too, so it is also a lost shard (invariant 4)
    assert kinds(found) == ["partial-version", "lost-version"]
    assert found[0].ops == [failed]


def test_a_version_whose_rank_died_mid_publish_may_stay_invisible_or_become_visible() -> None:
    killed = shard_pub(1, 2, 1.0, None, INFO)  # no completion: the process was killed
    never_visible = [*burst(1, 0.0), shard_pub(0, 2, 1.0, 1.1), killed,
                     latest(2.0, 2.1, 1, 11)]  # fmt: skip
    assert check(Facts(never_visible)) == []
    # its shard may have landed before the kill: the version may become visible with it
    assert check(Facts([*never_visible, latest(3.0, 3.1, 2, 21)])) == []


def test_a_shard_read_with_other_bytes_than_its_rank_published_is_torn() -> None:
    bad = fetch_shard(1, 1, 0.5, 0.6, content="not-rank-1")
    found = check(Facts([*burst(1, 0.0), bad]))
    assert kinds(found) == ["torn-read"]
    assert found[0].ops[0] is bad
    assert found[0].ops[1].args["shard"] == 1  # the publish it differs from


def test_a_shard_read_of_another_index_or_never_published_is_torn() -> None:
    swapped = op("sr#1", "fetch-shard", 0.5, 0.6, args={"version": 1, "shard": 0}, version=1,
                 shard=1, hash="h1.1")  # fmt: skip
    assert kinds(check(Facts([*burst(1, 0.0), swapped]))) == ["torn-read"]
    ghost = fetch_shard(1, 5, 0.5, 0.6)
    found = check(Facts([*burst(1, 0.0), ghost]))
    assert kinds(found) == ["torn-read"]
    assert "never published" in found[0].message


def test_a_refused_retry_of_a_shard_that_may_have_landed_is_reported() -> None:
    first = shard_pub(1, 1, 0.0, None, INFO)  # killed mid-publish
    retry = shard_pub(1, 1, 5.0, 10.0, INFO, gen=2, error="OutcomeUnknown: Deadline Exceeded")
    found = check(Facts([shard_pub(0, 1, 0.0, 0.1), first, retry]))
    assert kinds(found) == ["shard-retry"]
    assert found[0].invariant == 4
    assert found[0].ops == [first, retry]


def test_retries_that_landed_found_the_version_visible_or_met_a_fault_are_fine() -> None:
    first = shard_pub(1, 1, 0.0, None, INFO)
    base = [shard_pub(0, 1, 0.0, 0.1), first]
    landed = shard_pub(1, 1, 5.0, 5.2, gen=2, visible=True)
    assert check(Facts([*base, landed])) == []
    stale = shard_pub(1, 1, 5.0, 5.2, FAIL, gen=2, error="StaleVersion: not newer")
    assert check(Facts([*base, stale])) == []
    during_hub_kill = shard_pub(1, 1, 5.0, 6.0, INFO, gen=2, error="OutcomeUnknown: gone")
    hub = FaultWindow("kill-hub", "global", "hub 0", 5.5, 7.0)
    assert check(Facts([*base, during_hub_kill], [hub])) == []
    # a first publish that definitely failed made the next one a first try, not a retry
    refused = shard_pub(1, 1, 0.0, 0.1, FAIL, error="QuotaExceeded: later")
    fresh = shard_pub(1, 1, 5.0, 5.2, gen=2, visible=True)
    assert check(Facts([shard_pub(0, 1, 0.0, 0.1), refused, fresh])) == []


def test_latest_older_than_a_visible_shard_publish_acknowledged_before_it_is_stale() -> None:
    ops = [*burst(1, 0.0), *burst(2, 1.0)]
    stale = latest(2.0, 2.1, 1, 25)
    found = check(Facts([*ops, stale]))
    assert kinds(found) == ["stale-read"]
    assert found[0].ops[1] is stale


def test_a_shard_lost_while_its_rank_held_it_healthy_is_lost_but_not_after_a_kill() -> None:
    ops = burst(1, 0.0)
    failed = fetch_shard(1, 1, 10.0, 10.5, error="VersionUnavailable: no holder")
    alive = {"rank-0#1": (0.0, 60.0), "rank-1#1": (0.0, 60.0)}
    found = check(Facts([*ops, failed], incarnations=alive))
    assert kinds(found) == ["lost-version"]
    assert "shard 1 of policy-mp@1" in found[0].message
    kill = FaultWindow("kill-rank", "holder", "rank-1", 8.0, 9.0)
    assert check(Facts([*ops, failed], [kill], alive)) == []


def test_the_whole_version_checks_leave_the_model_parallel_model_alone() -> None:
    """A `latest` of the sharded model is no phantom of the whole-version model's publishes."""
    ops = [*burst(1, 0.0), latest(0.3, 0.35, 1, 11),
           op("p#1", "publish", 0.0, 0.1, args={"model": "policy", "version": 3, "hash": "x"},
              version=3, revision=5)]  # fmt: skip
    assert check(Facts(ops)) == []
