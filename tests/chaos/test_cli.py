"""`tensorhub chaos run` argument checks (no cluster is started for bad arguments)."""

from __future__ import annotations

import pytest

from ros.cli import main


def test_unknown_failpoint_is_refused_before_anything_starts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["chaos", "run", "--duration", "5", "--faults", "no-such-fault"]) == 1
    assert "unknown failpoint" in capsys.readouterr().err
