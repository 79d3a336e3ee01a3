"""Planted bugs: test-only switches that break one safety check, so chaos runs can prove
that their checker notices (docs/chaos.md).

A bug is planted only when the environment variable `TENSORHUB_PLANTED_BUG` names it; it is
unset in every normal run, so this is off by default. Known names:

- `no-revision-floor`: `RevisionFloor.accept` accepts answers older than the floor.
- `no-version-check`: the reader accepts chunks of the wrong version or with a bad checksum,
  and skips the check against the publisher's manifest checksums.

Never set it outside tests.
"""

from __future__ import annotations

import os

ENV = "TENSORHUB_PLANTED_BUG"
KNOWN = ("no-revision-floor", "no-version-check")


def planted_bug(name: str) -> bool:
    """True when the test-only bug `name` is switched on in this process's environment."""
    return name in os.environ.get(ENV, "").split(",")
