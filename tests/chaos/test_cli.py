"""`tensorhub chaos run` argument checks (no cluster is started for bad arguments)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from chaos import runner
from chaos.cluster import ChaosCluster
from chaos.runner import RunConfig
from ros.cli import main
from tensorhub.errors import DeadlineExceeded


def test_unknown_failpoint_is_refused_before_anything_starts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["chaos", "run", "--duration", "5", "--faults", "no-such-fault"]) == 1
    assert "unknown failpoint" in capsys.readouterr().err


def _failing_start(
    monkeypatch: pytest.MonkeyPatch, error: BaseException
) -> tuple[RunConfig, list[str]]:
    """A run whose cluster fails to start with `error` (no namespace, no real cluster)."""

    def start(self: ChaosCluster) -> ChaosCluster:
        raise error

    monkeypatch.setattr(runner, "unavailable_reason", lambda: "not in this test")
    monkeypatch.setattr(ChaosCluster, "start", start)
    said: list[str] = []
    return RunConfig(duration=5, progress=said.append), said


def _work_dir(said: list[str]) -> Path:
    (line,) = [s for s in said if s.startswith("work dir ")]
    return Path(line.removeprefix("work dir "))


def test_a_run_that_fails_at_start_up_keeps_its_work_dir_and_says_where(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through `runner.run` itself: its cleanup once ran as `stack.close()`, which tells the
    exit callbacks there was no error, so the dir the error pointed at was deleted anyway."""
    config, said = _failing_start(monkeypatch, DeadlineExceeded("hub 0 did not start; see …"))
    with pytest.raises(DeadlineExceeded):
        runner.run(config)
    root = _work_dir(said)
    try:
        assert root.is_dir()
        assert f"kept the work dir for its logs: {root}" in capsys.readouterr().err
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_an_interrupted_run_still_removes_its_work_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    config, said = _failing_start(monkeypatch, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        runner.run(config)
    assert not _work_dir(said).exists()


def test_a_model_parallel_run_needs_ranks_and_says_so_before_anything_starts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["chaos", "run", "--duration", "5", "--workload", "model-parallel", "--ranks", "0"]
    assert main(argv) == 1
    assert "ranks must be 1..64" in capsys.readouterr().err


def test_the_workloads_name_their_processes() -> None:
    """`model-parallel` runs ranks and shard readers instead of the whole-version clients
    (the intruder stays); `mixed` runs both; `whole` runs no rank."""
    sharded = runner.for_workload("model-parallel", 16)
    assert (sharded.ranks, sharded.shard_readers, sharded.intruders) == (16, 2, 1)
    assert (sharded.publishers, sharded.readers, sharded.watchers, sharded.pollers) == (0,) * 4
    mixed = runner.for_workload("mixed", 4)
    assert (mixed.ranks, mixed.publishers, mixed.readers) == (4, 2, 2)
    assert runner.for_workload("whole").ranks == 0
