"""The hub process's collector settings (`ros.hub.collector`), in a process of its own: they
are process-wide, and this test process keeps CPython's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from ros.hub import collector

_PROBE = """
import gc, json
from ros.hub import collector
before = gc.get_threshold()
garbage = []
garbage.append(garbage)  # a cycle: collected before the freeze, not frozen
del garbage
collector.tune()
cycle = []
cycle.append(cycle)  # made after: young, collected by a collection
del cycle
print(json.dumps({
    "before": before,
    "after": gc.get_threshold(),
    "frozen": gc.get_freeze_count(),
    "collected": gc.collect(),
}))
"""


def test_tune_freezes_what_is_alive_and_raises_the_young_threshold() -> None:
    """After `tune`, the objects alive at start-up are frozen, the youngest generation
    collects every `YOUNG_THRESHOLD` net allocations and the older ones keep CPython's
    ratios; a cycle made later is still collected."""
    probe = subprocess.run(
        [sys.executable, "-c", _PROBE],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ},
        check=True,
    )
    seen = json.loads(probe.stdout)
    assert seen["before"] == [700, 10, 10]
    assert seen["after"] == [collector.YOUNG_THRESHOLD, *collector.OLDER_THRESHOLDS]
    assert seen["frozen"] > 1000  # the modules' objects, at least
    assert seen["collected"] >= 1  # the cycle made after the freeze
