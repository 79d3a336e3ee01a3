"""A delta reader in its own process, whose peak memory a test measures (issue 38, row 1).

Run from the repository root as
`python -m tests.ros.hostile_delta_reader_proc HUB TENANT TOKEN MODEL BASE VERSION`:
fetches MODEL@BASE and prints `{"ready": true}`; when a line arrives on stdin, resets the
process's peak RSS (`/proc/self/clear_refs`, 5), notes its RSS, fetches MODEL@VERSION into
the same memory (applying its delta where it can), and prints one JSON line: `rss` and
`peak` (bytes: before the fetch, and the most during it), `xxh3` (of each tensor's bytes),
`delta` (what the delta did), or `error` (the exception's class and message).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import sys

import torch
import xxhash

import ros


def _status(field: str) -> int:
    """A `/proc/self/status` field in bytes (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux 4.0+); False where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def main() -> int:
    ap = argparse.ArgumentParser()
    for name in ("hub", "tenant", "token", "model"):
        ap.add_argument(name)
    ap.add_argument("base", type=int)
    ap.add_argument("version", type=int)
    args = ap.parse_args()
    hub = ros.connect(args.hub, tenant=args.tenant, token=args.token)
    try:
        first = hub.fetch(args.model, args.base)
        first.release()
        print(json.dumps({"ready": True}), flush=True)
        sys.stdin.readline()
        reset = _reset_peak()
        rss = _status("VmRSS")
        out: dict[str, object] = {"rss": rss}
        try:
            held = hub.fetch(args.model, args.version, into=first.tensors)
            out["xxh3"] = {
                name: xxhash.xxh3_64_hexdigest(t.contiguous().view(-1).view(torch.uint8).numpy())
                for name, t in sorted(held.tensors.items())
            }
            out["delta"] = None if held.delta is None else dataclasses.asdict(held.delta)
        except Exception as exc:  # reported, not raised: the test judges it
            out["error"] = f"{type(exc).__name__}: {exc}"
        out["peak"] = (
            _status("VmHWM") if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        )
        print(json.dumps(out), flush=True)
    finally:
        hub.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
