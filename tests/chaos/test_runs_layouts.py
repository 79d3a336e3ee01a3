"""A real chaos run of the model-parallel workload with readers in a second layout, at its
smallest: 2 ranks publish their shards while a rank and a hub replica are killed; 2 layout
readers fetch blocks that cut across both ranks' shards (`fetch_slices(layout=...)`), serve
them to each other, and every block they ended with must be the ranks' bytes. With the
`no-version-check` bug planted and a holder corrupting chunks, the checker must say they are
not."""

from __future__ import annotations

import pytest

from chaos import runner
from chaos.checker_layouts import READER_ROLE, layout_warning
from chaos.history import OK
from chaos.report import summary

pytestmark = pytest.mark.slow


@pytest.mark.timeout(180)
def test_layout_readers_under_a_rank_and_a_hub_kill_end_on_the_ranks_bytes() -> None:
    config = runner.for_workload(
        "model-parallel", 2, duration=12.0, seed=3, faults=["kill-rank", "kill-hub"],
        intruders=0, shard_readers=0, layout_readers=2,
    )  # fmt: skip
    result = runner.run(config)
    report = summary(result)
    assert result.violations == [], report
    assert {f.name for f in result.faults if not f.error} >= {"kill-rank"}, report
    fetched = [op for op in result.ops if op.f == "fetch-layout" and op.outcome == OK]
    assert len(fetched) > 0, report
    assert layout_warning(result.ops, config.layout_readers) == ""
    # blocks spanning both ranks' shards, each compared with the ranks' bytes
    assert all(set(op.value["hashes"]) == {"w", "b"} for op in fetched), report
    # a layout reader served another: some fetch read from a layout reader, not the ranks
    assert any(
        any(str(s).startswith(READER_ROLE) for s in op.value["sources"]) for op in fetched
    ), report
    assert any(op.value["served"] for op in fetched), report


@pytest.mark.timeout(180)
def test_layout_readers_that_take_corrupt_chunks_unchecked_are_caught_by_the_checker() -> None:
    """The planted `no-version-check` bug: the layout readers take whatever bytes a holder
    sends, and a holder (a rank or the other layout reader) corrupts them; the checker must
    find blocks that are not the ranks' bytes."""
    config = runner.for_workload(
        "model-parallel", 2, duration=10.0, seed=4, faults=["corrupt-holder"], intruders=0,
        shard_readers=0, layout_readers=2, planted="no-version-check",
    )  # fmt: skip
    result = runner.run(config)
    report = summary(result)
    assert any(f.name == "corrupt-holder" and not f.error for f in result.faults), report
    assert result.violations, report
    assert {(v.kind, v.ops[0].f) for v in result.violations} == {("torn-read", "fetch-layout")}
    assert all("differ from the ranks' bytes" in v.message for v in result.violations), report
