"""The issue-25 review benches (`tensorhub bench revoke`, `tensorhub bench history-fill`),
briefly, against this checkout's hub: each meets its targets (real etcd, real hub
processes). Their before figures, against the hub at 35d0b56, are in CHANGELOG.md."""

from __future__ import annotations

from bench import review_fill, review_revoke


def test_revoke_lands_nothing_and_the_new_tenant_inherits_nothing() -> None:
    result = review_revoke.run(review_revoke.parse([]))
    assert result.ok, result.to_dict()
    outcomes = {row["step"]: row["outcome"] for row in result.details["steps"]}
    assert outcomes["old token: OpenSession (replica 2)"] == "PermissionDenied"
    assert outcomes["old token: Publish ghost2@1 (replica 2)"] == "PermissionDenied"
    figures = {f.name: f.value for f in result.figures}
    assert figures["old-token writes that landed (open, ghost, ghost2)"] == 0
    assert figures["models the new tenant inherited"] == 0


def test_history_fill_leaves_the_other_tenant_every_publish() -> None:
    """6 s, a 4 MiB manifest: A is refused by its budget after a few publishes, B's land."""
    result = review_fill.run(review_fill.parse(["--seconds", "6"]))
    assert result.ok, result.to_dict()
    details = result.details
    assert details["b"]["attempted"] >= 5
    assert details["b"]["landed"] == details["b"]["attempted"]
    assert details["alarms_seen"] == []
    assert 1 <= details["a"]["landed"] < details["a"]["attempted"]
    assert set(details["a"]["errors"]) == {"QuotaExceeded"}
