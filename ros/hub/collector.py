"""The hub process's cyclic garbage collector, set for a server that allocates in bursts.

A group publish of 4,096 shards allocates millions of short-lived objects on the hub's event
loop (each shard's checks, futures and records). With CPython's default thresholds (700, 10,
10) the collector runs every 700 net container allocations and, as the call's futures and
staged shards survive their first collections, promotes them until full collections scan the
whole heap (gRPC's and protobuf's objects included): a hub's run of one such call spent 0.13
s of CPU in 254 collections, 0.06 s in two full ones, on the threads that allocate, the
event loop above all, whose CPU is the call's critical path (docs/design-notes.md, "One hub
call per version from a process group").

`tune` (called once by `tensorhub serve`, after the hub has started) moves every object
alive then (modules, descriptors, the server's own structures, none of them garbage) to the
permanent generation, so no collection scans them again, and sets the youngest generation's
threshold to `YOUNG_THRESHOLD`: objects that die by reference count before that many net
allocations (almost all of a call's) never reach a collection; the older generations keep
CPython's ratios, so cycles are still collected, young ones at every collection of the
youngest generation and older ones in the older generations' turns. Objects without cycles
are freed by reference count whatever the thresholds; only cycles wait longer. It is set
for the hub process only: a process that embeds a `HubServer` (the tests) keeps its own
collector's settings.
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 50_000  # net container allocations between collections of the youngest
OLDER_THRESHOLDS = (10, 10)  # CPython's own: collections of one generation per the next's


def tune() -> None:
    """Freeze what is alive now and raise the youngest generation's threshold (module
    docstring). Call once, after the server has started."""
    gc.collect()  # what start-up left as garbage goes now, not into the permanent generation
    gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD, *OLDER_THRESHOLDS)
