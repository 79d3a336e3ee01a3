"""`tensorhub bench failover`: 3 holders serve one reader; one is SIGKILLed halfway.

Uses the transport data plane directly (`transport.reader.fetch` with three bare holder
servers on three emulated hosts), because what is measured is the reader's failover, not
the hub. A clean run gives T_clean; in the faulty run the orchestrator SIGKILLs holder 2's
process at T_clean / 2. The other holders take over its unfinished chunks at once.
Target: extra time <= detection (1 s) + the time to re-fetch, at the reader's link rate,
exactly the bytes not yet received (the fetch's `refetched_bytes` + `discarded_bytes`);
every chunk is completed exactly once, and only chunks in flight at the kill are fetched
again (their bytes are reported).
"""

from __future__ import annotations

import math
import statistics
import time

from bench.common import Options, span, verify
from bench.emu.cluster import Cluster
from bench.emu.control import broadcast
from bench.report import Result

DETECTION = 1.0
CLEAN_RUNS = 2
PARALLEL = 4  # baseline_ops.tfetch's default: connections per fetch


def run(opts: Options) -> Result:
    res = Result("failover", "tensorhub bench failover" + opts.flags())
    started = time.monotonic()
    with Cluster({1: 4}, opts.rate_mbit, hub=False) as c:
        holders, reader = c.parts[:3], c.parts[3]
        sat = c.saturation(c.parts, opts.nbytes)
        served = broadcast(
            holders, "serve", 60, nbytes=opts.nbytes, seed=opts.seed, chunk=opts.chunk
        )
        sources = [
            [f"h{i}", h.host.ip, s["port"]]
            for i, (h, s) in enumerate(zip(holders, served, strict=True))
        ]
        clean = []
        for _ in range(CLEAN_RUNS):
            got = reader.call("tfetch", 300, sources=sources, nbytes=opts.nbytes, chunk=opts.chunk)
            verify(served[0]["digest"], [got], "clean fetch")
            clean.append(span([got]))
        t_clean = statistics.median(clean)
        reader.send("tfetch", sources=sources, nbytes=opts.nbytes, chunk=opts.chunk)
        time.sleep(t_clean / 2)
        holders[0].kill()  # the first-ranked source: busy until the end
        got = reader.reply(300)
        verify(served[0]["digest"], [got], "fetch with a killed holder")
        t_fail = span([got])
    refetched = got["refetched_bytes"] + got["discarded_bytes"]
    received = sum(got["bytes_per_source"].values())
    bound = DETECTION + refetched / opts.rate_Bps
    extra = t_fail - t_clean
    res.add("extra time / (detection + re-fetch time)", max(extra, 0.0) / bound, "<= 1")
    # Each chunk is completed exactly once; only chunks cut mid-way by the kill (at most
    # one per connection to the killed holder) are received again.
    in_flight = math.ceil(PARALLEL / len(sources)) * opts.chunk
    res.add("chunk bytes completed / model", received / opts.nbytes, "<= 1.0")
    res.add("re-fetched / chunks in flight at the kill", refetched / in_flight, "<= 1")
    res.add("re-fetched", refetched / 1024, unit="KiB")
    res.add("extra time", extra, unit="s")
    res.details = {
        "saturation": sat.to_dict(),
        "clean_s": clean,
        "failed_s": t_fail,
        "refetched_bytes": got["refetched_bytes"],
        "discarded_bytes": got["discarded_bytes"],
        "bytes_per_source": got["bytes_per_source"],
        "failed_sources": got["failed_sources"],
        "bound_s": bound,
    }
    if not got["failed_sources"]:
        res.note = "the killed holder was not seen to fail (the fetch ended before the kill)"
    if not sat.saturated:
        res.withhold(f"a plain socket reached only {sat.fraction:.0%} of the link rate")
    res.seconds = time.monotonic() - started
    return res
