"""Waiting for a condition in a test: polled, bounded, and named when it fails."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(what: str, check: Callable[[], object], timeout: float = 10.0) -> None:
    """Poll `check` every 50 ms until it is true; fail the test after `timeout` seconds,
    saying `what` was awaited."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:.0f}s: {what}")
        time.sleep(0.05)
