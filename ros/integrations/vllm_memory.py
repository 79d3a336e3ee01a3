"""A vLLM worker's resident host memory, for what an update costs it (Linux /proc).

`start_window` resets the process's peak resident size (`/proc/self/clear_refs`, "5") and
answers the resident size then; `resident` answers the size now and the peak since that
reset (or since the process began, where the reset is refused). The growth of one update is
its peak less the size before it: what the update's fetch and load added, however briefly.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def resident() -> dict[str, int]:
    """`rss` (resident bytes now) and `rss_peak` (the highest since the last reset), from
    /proc/self/status; both 0 where there is no /proc."""
    out = {"rss": 0, "rss_peak": 0}
    try:
        with open("/proc/self/status") as status:
            for line in status:
                key, _, value = line.partition(":")
                if key == "VmRSS":
                    out["rss"] = int(value.split()[0]) * 1024
                elif key == "VmHWM":
                    out["rss_peak"] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


def start_window() -> int:
    """Reset the peak resident size to the size now, and answer that size (bytes)."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
    except OSError as exc:  # no /proc, or not allowed: the peak is the process's own
        log.debug("peak resident size not reset: %s", exc)
    return resident()["rss"]
