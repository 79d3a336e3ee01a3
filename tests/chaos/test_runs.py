"""Real chaos runs (etcd cluster, hub processes, worker processes): the smoke run must end
with zero violations, having applied delta versions under its faults, and with a bug planted
the checker must report it."""

from __future__ import annotations

import pytest

from chaos import runner
from chaos.deltas import delta_counts
from chaos.report import delta_warning, summary
from chaos.runner import RunConfig, RunResult

pytestmark = pytest.mark.slow


def kinds(result: RunResult) -> set[str]:
    return {v.kind for v in result.violations}


@pytest.mark.timeout(170)
def test_smoke_run_with_every_available_fault_has_no_violation() -> None:
    result = runner.run(RunConfig(duration=50.0, seed=7))
    report = summary(result)
    assert result.violations == [], report
    injected = {f.name for f in result.faults if not f.error}
    assert len(injected) >= 8, report
    ok = [op for op in result.ops if op.outcome == "ok"]
    assert sum(op.f == "fetch" for op in ok) > 20, report
    assert sum(op.f == "publish" for op in ok) > 20, report
    assert any(op.f == "probe" and op.value["result"] == "refused" for op in ok), report
    # delta reads ran under the faults, and were checked byte for byte like the rest
    deltas = delta_counts(result.ops)
    assert delta_warning(result) == "", report
    assert deltas["publishes with a delta"] > 10, report
    assert deltas["fetches that applied a delta"] > 10, report
    assert deltas["of those, a chain of 2 or more deltas"] > 0, report
    assert deltas["fetches that found their memory not the base (chunks read whole)"] > 0, report
    assert any(op.f == "probe" and op.args["model"] == "policy.delta" for op in ok), report


@pytest.mark.timeout(100)
def test_planted_no_version_check_is_caught_as_a_torn_read() -> None:
    """Readers that skip the version and checksum checks take a corrupting holder's bytes.
    12 s: the holder corrupts twice (from about 2.4 s and 6 s); each time torn reads follow
    within a second."""
    config = RunConfig(
        duration=12.0, seed=11, faults=["corrupt-holder"], planted="no-version-check",
        publishers=1, readers=2, watchers=0, pollers=0, intruders=0,
    )  # fmt: skip
    result = runner.run(config)
    assert "torn-read" in kinds(result), summary(result)


@pytest.mark.timeout(100)
def test_planted_no_revision_floor_is_caught_going_back_in_time() -> None:
    """A client without its revision floor believes a stale replica. 9 s: the stale
    replica serves the poller once (about 2.8 s to 5.9 s), which reads it at once."""
    config = RunConfig(
        duration=9.0, seed=5, faults=["stale-replica"], planted="no-revision-floor",
        publishers=1, readers=0, watchers=0, intruders=0,
    )  # fmt: skip
    result = runner.run(config)
    assert kinds(result) & {"non-monotonic", "stale-read"}, summary(result)
