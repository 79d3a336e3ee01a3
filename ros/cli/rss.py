"""This process's memory, as the kernel counts it: what `fetch` and `publish` report.

`VmRSS` is resident memory now and `VmHWM` its peak over the process's life (both count the
pages of mapped files that are resident, not only anonymous memory); `RssAnon` and
`RssFile` split the current figure. Read from /proc/self/status (Linux); elsewhere the peak
comes from `getrusage` and the rest reads 0.
"""

from __future__ import annotations

import resource
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Memory:
    """Bytes: resident now, its peak, and the anonymous / file-backed parts of `rss`."""

    rss: int
    peak: int
    anon: int
    file: int


def memory() -> Memory:
    fields: dict[str, int] = {}
    try:
        with open("/proc/self/status") as status:
            for line in status:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                    fields[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    if "VmHWM" not in fields:
        scale = 1 if sys.platform == "darwin" else 1024
        fields["VmHWM"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
    return Memory(
        fields.get("VmRSS", 0), fields["VmHWM"], fields.get("RssAnon", 0), fields.get("RssFile", 0)
    )


def mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


_LIBC: object = None


def give_back_freed() -> bool:
    """Return the free memory of every glibc arena to the system (`malloc_trim(0)`); False
    where this is no glibc.

    A fetch allocates and frees a batch's buffers again and again, from two threads. glibc
    raises its mmap threshold to the size of buffers freed (up to 32 MiB), after which such
    buffers come from the heap and the arenas of both threads, and their freed pages stay
    resident: measured, a 512 MiB fetch in batches of 32 MiB peaked 167 MiB over its
    baseline. Trimming after each `fetch_slices` call (its staged chunks) and after each
    batch is written gives them back: 128 MiB in files of 16 MB then peaked 26-30 MiB over
    the baseline (42-54 MiB trimming after the writes only). It is a call, not a setting:
    the process's allocator keeps its defaults (a test that fetches in-process leaves the
    rest of its run as it was).
    """
    global _LIBC
    try:
        import ctypes

        if _LIBC is None:
            _LIBC = ctypes.CDLL("libc.so.6")
        return bool(_LIBC.malloc_trim(0))  # type: ignore[attr-defined]
    except (OSError, AttributeError):
        return False
