"""A vLLM worker's resident host memory, for what an update costs it (Linux /proc).

`start_window` resets the process's peak resident size (`/proc/self/clear_refs`, "5") and
answers the resident size then; `resident` answers the size now and the peak since that
reset (or since the process began, where the reset is refused). The growth of one update is
its peak less the size before it: what the update's fetch and load added, however briefly.

`UpdateMemory` splits an update in two windows: the fetch (TensorHub's: the blocks or the
checkpoint copy read, and the SDK's staging) and the load (vLLM's layerwise reload, which
materialises each layer afresh and, on the CPU build, repacks its weights), so each part's
peak is known. Between them and after the load it hands the freed memory of glibc's arenas
back to the system (`ros.cli.rss.give_back_freed`): the fetch frees its staged chunks and
the load its materialised layers, whose pages glibc would otherwise keep resident (its mmap
threshold rises to the size of each large block freed), so they would be counted in the
next window and between updates.
"""

from __future__ import annotations

import logging

from ros.cli.rss import give_back_freed

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


class UpdateMemory:
    """One update's resident memory, in two windows: `start` (before the fetch),
    `fetched` (the fetch's peak; the load's window starts), `loaded` (the load's peak and
    what stays). Bytes; one update at a time."""

    def __init__(self) -> None:
        self._figures: dict[str, int] = {}

    def start(self) -> None:
        give_back_freed()  # what was freed before the update: its baseline is live memory
        self._figures = {"rss_before": start_window()}

    def fetched(self) -> None:
        self._figures["rss_fetch_peak"] = resident()["rss_peak"]
        give_back_freed()  # the fetch's staged chunks, freed as it returned
        self._figures["rss_load_start"] = start_window()

    def loaded(self) -> dict[str, int]:
        """The update's figures: `rss_before`, `rss_fetch_peak`, `rss_load_start`,
        `rss_load_peak`, `rss_peak` (the higher of the two peaks) and `rss_after`
        (after the load's freed memory went back)."""
        figures = dict(self._figures)
        figures["rss_load_peak"] = resident()["rss_peak"]
        give_back_freed()  # vLLM's materialised layers, freed as each was copied back
        figures["rss_after"] = resident()["rss"]
        figures["rss_peak"] = max(figures.get("rss_fetch_peak", 0), figures["rss_load_peak"])
        return figures
