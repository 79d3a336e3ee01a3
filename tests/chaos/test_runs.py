"""Real chaos runs (etcd cluster, hub processes, worker processes): the smoke run must end
with zero violations, and with a bug planted the checker must report it."""

from __future__ import annotations

import warnings

import pytest

from chaos import runner
from chaos.checker import Violation
from chaos.report import summary
from chaos.runner import RunConfig, RunResult

pytestmark = pytest.mark.slow


def kinds(result: RunResult) -> set[str]:
    return {v.kind for v in result.violations}


def known_issue(v: Violation, result: RunResult) -> bool:
    """KNOWN BUG (docs/chaos.md, "Found"): a pipelined fetch whose one predecessor sends
    corrupt bytes fails with IntegrityError instead of falling back to the other holders.
    Matched narrowly; delete this filter once `transport.reader.fetch` re-plans on it."""
    fetch = v.ops[-1]
    return (
        v.kind == "lost-version"
        and fetch.error.startswith("IntegrityError")
        and any(
            f.name == "corrupt-holder" and f.start <= fetch.end and f.end >= fetch.invoke
            for f in result.faults
        )
    )


@pytest.mark.timeout(170)
def test_smoke_run_with_every_available_fault_has_no_violation() -> None:
    result = runner.run(RunConfig(duration=50.0, seed=7))
    report = summary(result)
    unexpected = [v for v in result.violations if not known_issue(v, result)]
    assert unexpected == [], report
    if result.violations:
        warnings.warn(f"known issue hit: {report}", stacklevel=1)
    injected = {f.name for f in result.faults if not f.error}
    assert len(injected) >= 8, report
    ok = [op for op in result.ops if op.outcome == "ok"]
    assert sum(op.f == "fetch" for op in ok) > 20, report
    assert sum(op.f == "publish" for op in ok) > 20, report
    assert any(op.f == "probe" and op.value["result"] == "refused" for op in ok), report


@pytest.mark.timeout(100)
def test_planted_no_version_check_is_caught_as_a_torn_read() -> None:
    """Readers that skip the version and checksum checks take a corrupting holder's bytes."""
    config = RunConfig(
        duration=15.0, seed=11, faults=["corrupt-holder"], planted="no-version-check",
        publishers=1, readers=2, watchers=0, pollers=0, intruders=0,
    )  # fmt: skip
    result = runner.run(config)
    assert "torn-read" in kinds(result), summary(result)


@pytest.mark.timeout(100)
def test_planted_no_revision_floor_is_caught_going_back_in_time() -> None:
    """A client without its revision floor believes a stale replica."""
    config = RunConfig(
        duration=12.0, seed=5, faults=["stale-replica"], planted="no-revision-floor",
        publishers=1, readers=0, watchers=0, intruders=0,
    )  # fmt: skip
    result = runner.run(config)
    assert kinds(result) & {"non-monotonic", "stale-read"}, summary(result)
