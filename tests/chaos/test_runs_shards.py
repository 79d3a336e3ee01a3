"""A real chaos run of the model-parallel workload: 16 rank processes publish one shard each
of every version while a rank and a hub replica are killed mid-burst; the history must show
every visible version whole, every shard read with its rank's bytes, and no violation."""

from __future__ import annotations

import pytest

from chaos import runner
from chaos.checker_shards import seen_visible
from chaos.history import OK
from chaos.report import summary

pytestmark = pytest.mark.slow


@pytest.mark.timeout(180)
def test_model_parallel_run_with_a_rank_and_a_hub_killed_mid_burst_has_no_violation() -> None:
    config = runner.for_workload(
        "model-parallel", 16, duration=20.0, seed=3, faults=["kill-rank", "kill-hub"],
        intruders=0, layout_readers=0,  # tests/chaos/test_runs_layouts.py runs those
    )  # fmt: skip
    result = runner.run(config)
    report = summary(result)
    assert result.violations == [], report
    assert {f.name for f in result.faults if not f.error} == {"kill-rank", "kill-hub"}, report
    ops = result.ops
    killed = {f.target for f in result.faults if f.name == "kill-rank" and not f.error}
    # a killed rank died publishing its shard (the failpoint kills one caught mid-publish; it
    # may finish in the moment before the signal lands, so one such kill is required, not
    # all), and every killed rank came back publishing
    shards = [op for op in ops if op.f == "publish-shard"]
    assert any(op.worker in killed and op.complete is None for op in shards), report
    for rank in killed:
        assert any(op.worker == rank and op.client != f"{rank}#1" and op.outcome == OK
                   for op in shards), report  # fmt: skip
    # the hub failpoint struck while it saw a rank publishing (it says so in its target)
    assert any(f.target.endswith("(mid-burst)") for f in result.faults if f.name == "kill-hub")
    ok = [op for op in ops if op.outcome == OK]
    visible = {seen_visible(op) for op in ops} - {0}
    assert len(visible) >= 5, report
    fetched = {op.args["shard"] for op in ok if op.f == "fetch-shard"}
    assert len(fetched) >= 8, report  # shards of many ranks compared byte for byte
    assert sum(op.f == "inspect-shards" for op in ok) >= 5, report
