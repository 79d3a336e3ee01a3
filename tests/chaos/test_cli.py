"""`tensorhub chaos run` argument checks (no cluster is started for bad arguments)."""

from __future__ import annotations

import contextlib
import shutil

import pytest

from ros.cli import main


def test_unknown_failpoint_is_refused_before_anything_starts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["chaos", "run", "--duration", "5", "--faults", "no-such-fault"]) == 1
    assert "unknown failpoint" in capsys.readouterr().err


def test_a_run_that_fails_keeps_its_work_dir_for_the_logs_it_points_at(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from chaos.runner import RunConfig, _Run

    with contextlib.ExitStack() as stack:
        done = _Run(RunConfig(), stack)
    assert not done.root.exists()  # a run that ended normally cleans up
    runs: list[_Run] = []

    def fail_during_start_up() -> None:
        with contextlib.ExitStack() as stack:
            runs.append(_Run(RunConfig(), stack))
            raise RuntimeError("hub 0 did not start; see hub0.log")

    with pytest.raises(RuntimeError):
        fail_during_start_up()
    (failed,) = runs
    assert failed.root.exists()
    assert str(failed.root) in capsys.readouterr().err
    shutil.rmtree(failed.root)
