"""The checker on hand-built histories: each invariant's violation is reported, with the
operations that prove it, and the legitimate look-alikes are not."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from chaos.checker import Facts, FaultWindow, Violation, check
from chaos.history import FAIL, INFO, OK, Op

_ids = iter(range(1, 10_000))


def op(
    client: str, f: str, invoke: float, complete: float | None, outcome: str = OK,
    timeout: float = 5.0, error: str = "", args: dict[str, Any] | None = None, **value: Any,
) -> Op:  # fmt: skip
    return Op(next(_ids), client, f, invoke, timeout, args or {}, outcome, complete, value, error)


def publish(client: str, version: int, t0: float, t1: float | None, outcome: str = OK,
            revision: int = 0, content: str = "") -> Op:  # fmt: skip
    value = {"version": version, "revision": revision or version * 10} if outcome == OK else {}
    args = {"model": "policy", "version": version, "hash": content or f"h{version}"}
    return op(client, "publish", t0, t1, outcome, 10.0, args=args, **value)


def latest(client: str, t0: float, t1: float, version: int, revision: int) -> Op:
    return op(client, "latest", t0, t1, args={"model": "policy"}, version=version,
              revision=revision)  # fmt: skip


def fetch(client: str, version: int, t0: float, t1: float, content: str = "",
          error: str = "") -> Op:  # fmt: skip
    args = {"model": "policy", "version": version}
    if error:
        return op(client, "fetch", t0, t1, FAIL, 20.0, error, args)
    return op(client, "fetch", t0, t1, args=args, version=version, hash=content or f"h{version}")


def kinds(violations: list[Violation]) -> list[str]:
    return [v.kind for v in violations]


def test_a_clean_history_has_no_violation() -> None:
    ops = [
        publish("p#1", 1, 0.0, 0.1),
        latest("l#1", 0.2, 0.3, 1, 10),
        fetch("r#1", 1, 0.4, 0.6),
        publish("p#1", 2, 1.0, 1.1),
        latest("l#1", 1.2, 1.3, 2, 20),
    ]
    assert check(Facts(ops)) == []


def test_torn_read_is_reported_with_the_publish() -> None:
    pub = publish("p#1", 1, 0.0, 0.1, content="good")
    bad = fetch("r#1", 1, 0.2, 0.4, content="torn")
    found = check(Facts([pub, bad]))
    assert kinds(found) == ["torn-read"]
    assert found[0].invariant == 1
    assert found[0].ops == [bad, pub]


def test_a_fetch_of_a_version_never_published_is_torn() -> None:
    assert kinds(check(Facts([fetch("r#1", 7, 0.2, 0.4)]))) == ["torn-read"]


def test_an_unknown_publish_may_explain_a_fetch_but_an_ok_one_takes_precedence() -> None:
    lost_reply = publish("p#1", 1, 0.0, None, INFO, content="a")
    assert check(Facts([lost_reply, fetch("r#1", 1, 0.2, 0.4, content="a")])) == []
    landed = publish("p#2", 1, 0.5, 0.6, content="b")
    found = check(Facts([lost_reply, landed, fetch("r#1", 1, 0.7, 0.8, content="a")]))
    assert kinds(found) == ["torn-read"]


def test_stale_latest_after_a_completed_publish() -> None:
    pub = publish("p#1", 2, 0.0, 0.1, revision=20)
    stale = latest("l#1", 0.2, 0.3, 1, 25)
    found = check(Facts([publish("p#1", 1, -1.0, -0.9), pub, stale]))
    assert kinds(found) == ["stale-read"]
    assert found[0].invariant == 2
    assert found[0].ops == [pub, stale]


def test_latest_at_a_revision_older_than_an_acknowledged_publish() -> None:
    pub = publish("p#1", 2, 0.0, 0.1, revision=20)
    found = check(Facts([pub, latest("l#1", 0.2, 0.3, 2, 19)]))
    assert kinds(found) == ["stale-read"]


def test_latest_concurrent_with_a_publish_may_see_either() -> None:
    pub = publish("p#1", 2, 0.0, 0.5)
    ops = [publish("p#1", 1, -1.0, -0.9), pub, latest("l#1", 0.1, 0.2, 1, 10),
           latest("m#1", 0.3, 0.4, 2, 20)]  # fmt: skip
    assert check(Facts(ops)) == []


def test_latest_may_show_an_unknown_publish_but_never_a_failed_one() -> None:
    maybe = publish("p#1", 3, 0.0, 0.5, INFO)
    assert check(Facts([maybe, latest("l#1", 1.0, 1.1, 3, 30)])) == []
    failed = publish("p#1", 4, 0.0, 0.5, FAIL)
    found = check(Facts([failed, latest("l#1", 1.0, 1.1, 4, 40)]))
    assert "phantom-read" in kinds(found)


def test_backwards_latest_is_non_monotonic() -> None:
    ops = [publish("p#1", 1, 0.0, 0.1), publish("p#1", 2, 0.2, 0.3),
           latest("l#1", 0.25, 0.26, 2, 20), latest("l#1", 0.27, 0.28, 1, 10)]  # fmt: skip
    found = check(Facts(ops))
    assert "non-monotonic" in kinds(found)
    v = next(v for v in found if v.kind == "non-monotonic")
    assert v.invariant == 3
    assert [o.value["version"] for o in v.ops] == [2, 1]


def test_different_clients_may_see_different_orders_of_concurrent_reads() -> None:
    ops = [publish("p#1", 2, 0.0, 1.0), latest("a#1", 0.1, 0.2, 2, 20),
           latest("b#1", 0.3, 0.4, 1, 10)]  # fmt: skip
    assert check(Facts([publish("p#1", 1, -1.0, -0.9), *ops])) == []


def test_an_operation_past_its_deadline() -> None:
    slow = op("r#1", "latest", 0.0, 9.0, timeout=5.0, args={"model": "policy"}, version=0,
              revision=5)  # fmt: skip
    found = check(Facts([slow], grace=2.0))
    assert kinds(found) == ["past-deadline"]
    assert found[0].invariant == 5


def test_a_frozen_process_is_not_blamed_for_its_deadline() -> None:
    slow = op("reader-0#1", "release", 0.0, 9.0, timeout=5.0, args={"version": 1})
    pause = FaultWindow("pause-holder", "holder", "reader-0", 1.0, 4.0)
    assert check(Facts([slow], [pause])) == []


def test_cross_tenant_success_is_reported() -> None:
    probe = op("intruder-0#1", "probe", 0.0, 0.1, args={"probe": "holder-own-tenant"},
               result="allowed", detail="sent a CHUNK")  # fmt: skip
    refused = op("intruder-0#1", "probe", 0.2, 0.3, args={"probe": "hub-latest"},
                 result="refused", detail="latest=0")  # fmt: skip
    found = check(Facts([probe, refused]))
    assert kinds(found) == ["cross-tenant"]
    assert found[0].ops == [probe]


def test_a_lost_version_while_its_holder_lived() -> None:
    pub = publish("p#1", 1, 0.0, 0.1)
    failed = fetch("r#1", 1, 10.0, 10.5, error="VersionUnavailable: no holder left")
    found = check(Facts([pub, failed], incarnations={"p#1": (0.0, 60.0)}))
    assert kinds(found) == ["lost-version"]
    assert found[0].ops == [pub, failed]


def test_loss_is_excused_by_a_fault_a_release_a_death_or_retention() -> None:
    pub = publish("p#1", 1, 0.0, 0.1)
    failed = fetch("r#1", 1, 10.0, 10.5, error="VersionUnavailable: no holder left")
    alive = {"p#1": (0.0, 60.0)}
    kill = FaultWindow("kill-holder", "holder", "p", 9.0, 9.5)
    assert check(Facts([pub, failed], [kill], alive)) == []
    hub = FaultWindow("kill-hub", "global", "hub 0", 5.0, 6.0)
    assert check(Facts([pub, failed], [hub], alive)) == []
    released = op("p#1", "release", 9.9, 10.0, args={"model": "policy", "version": 1})
    assert check(Facts([pub, released, failed], [], alive)) == []
    assert check(Facts([pub, failed], [], {"p#1": (0.0, 10.2)})) == []
    newer = [publish("p#1", 2, 1.0, 1.1), publish("p#1", 3, 2.0, 2.1)]
    assert check(Facts([pub, *newer, failed], [], alive)) == []


def test_integrity_error_while_a_healthy_holder_had_good_bytes_is_a_loss() -> None:
    pub = publish("p#1", 1, 0.0, 0.1)
    failed = fetch("r#1", 1, 10.0, 10.5, error="IntegrityError: no holder had intact bytes")
    corrupt_peer = FaultWindow("corrupt-holder", "holder", "q", 9.0, 11.0)
    found = check(Facts([pub, failed], [corrupt_peer], {"p#1": (0.0, 60.0)}))
    assert kinds(found) == ["lost-version"]
    own_lease = FaultWindow("expire-lease", "holder", "r", 9.0, 9.5)
    assert check(Facts([pub, failed], [own_lease], {"p#1": (0.0, 60.0)})) == []


def test_a_saved_report_is_checked_again(tmp_path: Path) -> None:
    from chaos.recheck import recheck
    from chaos.report import write_json
    from chaos.runner import RunConfig, RunResult

    ops = [
        publish("p#1", 1, -1.0, -0.9),
        publish("p#1", 2, 0.0, 0.1),
        latest("l#1", 0.2, 0.3, 1, 5),
    ]
    incarnations = [{"client": c, "started": 0.0, "ended": 1.0, "how": "exit 0"}
                    for c in ("p#1", "l#1")]  # fmt: skip
    result = RunResult(RunConfig(), 0.0, 1.0, [], {}, ops, [], incarnations, "")
    write_json(result, tmp_path / "run.json")
    violations, _ = recheck(tmp_path / "run.json")
    assert {v.kind for v in violations} == {"stale-read"}


def watch_open(client: str, t: float, since: int, versions_only: bool = False) -> Op:
    return op(client, "watch-open", t, t, timeout=0.0, since=since, versions_only=versions_only)


def watched(client: str, t: float, version: int, revision: int, f: str = "watch") -> Op:
    return op(client, f, t, t, timeout=0.0, version=version, revision=revision)


def test_a_watcher_that_skipped_an_acknowledged_publish_is_reported() -> None:
    ops = [
        watch_open("w#1", 0.0, since=5),
        publish("p#1", 1, 0.1, 0.2),  # revision 10
        publish("p#1", 2, 0.3, 0.4),  # revision 20: never delivered
        publish("p#1", 3, 0.5, 0.6),  # revision 30
        watched("w#1", 0.25, 1, 10),
        watched("w#1", 0.65, 3, 30),
    ]
    found = check(Facts(ops))
    assert kinds(found) == ["missed-watch"]
    assert "policy@2" in found[0].message
    assert found[0].ops[0].args["version"] == 2


def test_publishes_outside_the_watched_range_or_excused_by_a_resync_are_not_missed() -> None:
    ops = [
        publish("p#1", 1, 0.0, 0.1),  # revision 10: before the watch started (since=15)
        watch_open("w#1", 0.15, since=15),
        publish("p#1", 2, 0.2, 0.3),  # revision 20: jumped over by the resync at 25
        watched("w#1", 0.4, 2, 25, f="watch-resync"),
        publish("p#1", 3, 0.5, 0.6),  # revision 30
        watched("w#1", 0.65, 3, 30),
        publish("p#1", 4, 0.7, 0.8),  # revision 40: after the last event (run ended)
        publish("p#1", 5, 0.7, None, outcome=INFO),  # unknown outcome: never required
    ]
    assert check(Facts(ops)) == []


def test_a_versions_only_watcher_that_got_a_holder_event_is_reported() -> None:
    ops = [
        watch_open("w#1", 0.0, since=5, versions_only=True),
        publish("p#1", 1, 0.1, 0.2),
        watched("w#1", 0.25, 1, 10),
        op("w#1", "watch-unwanted", 0.26, 0.26, timeout=0.0, kind="HOLDER_UPDATED", revision=10),
    ]
    assert kinds(check(Facts(ops))) == ["watch-filter"]
