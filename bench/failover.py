"""`tensorhub bench failover`: 3 holders serve one reader; one is SIGKILLed halfway.

Uses the transport data plane directly (`transport.reader.fetch` with three bare holder
servers on three emulated hosts), because what is measured is the reader's failover, not
the hub. A clean run gives T_clean; in the faulty run the orchestrator SIGKILLs holder 2's
process at T_clean / 2. The other holders take over its unfinished chunks at once.
Target: extra time <= detection (1 s) + the time to re-fetch, at the reader's link rate,
exactly the bytes not yet received (the fetch's `refetched_bytes` + `discarded_bytes`);
every chunk is completed exactly once, and only chunks in flight at the kill are fetched
again (their bytes are reported).

`--transport nixl`: each holder also serves the model on a bare `NixlHolder`, and the reader
reads all three over NIXL (UCX over TCP on each host's veth); the targets are the same, with
what a connection has in flight at the kill being its window of READs rather than one chunk.
Each fetch checks the host links' byte counters against the one copy it moved
(`LinksBypassed`), and its reads are counted by transport (`reads`). A NIXL run first
fetches once untimed (`details["nixl_warmup_s"]`): each holder makes its NIXL agent and
registers the model for its first reader, which the faulty run, after the clean ones, no
longer pays, so a clean run that paid it would shrink the extra time.
"""

from __future__ import annotations

import math
import statistics
import time

from bench.common import Options, add_reads, reads, span, transport_figures, verify
from bench.emu.cluster import Cluster, Links
from bench.emu.control import broadcast
from bench.report import Result

DETECTION = 1.0
CLEAN_RUNS = 2
PARALLEL = 4  # baseline_ops.tfetch's default: connections per fetch


def _in_flight(opts: Options) -> int:
    """Bytes one connection has asked for and not yet committed: over TCP one chunk; over
    NIXL its window of READs (`transport.nixl.reader`: `WINDOW` READs of `READ_BYTES`, each
    at least one chunk), which land whole or not at all."""
    if opts.transport != "nixl":
        return opts.chunk
    from transport.nixl.reader import READ_BYTES, WINDOW

    return WINDOW * max(opts.chunk, READ_BYTES // opts.chunk * opts.chunk)


def run(opts: Options) -> Result:
    res = Result("failover", "tensorhub bench failover" + opts.flags())
    started = time.monotonic()
    fetch = {"nbytes": opts.nbytes, "chunk": opts.chunk, "transport": opts.transport}
    with Cluster({1: 4}, opts.rate_mbit, hub=False, transport=opts.transport) as c:
        holders, reader = c.parts[:3], c.parts[3]
        sat = c.saturation(c.parts, opts.nbytes)
        served = broadcast(
            holders, "serve", 60, nbytes=opts.nbytes, seed=opts.seed, chunk=opts.chunk,
            transport=opts.transport,
        )  # fmt: skip
        sources = [
            [f"h{i}", h.host.ip, s["port"]]
            for i, (h, s) in enumerate(zip(holders, served, strict=True))
        ]
        warmup = None
        if opts.transport == "nixl":
            got = reader.call("tfetch", 300, sources=sources, **fetch)
            verify(served[0]["digest"], [got], "warm-up fetch")
            warmup = span([got])
        clean = []
        links: list[Links] = []
        used: dict[str, int] = {}
        for run_ in range(CLEAN_RUNS):
            before = c.link_bytes()
            got = reader.call("tfetch", 300, sources=sources, **fetch)
            verify(served[0]["digest"], [got], "clean fetch")
            links.append(c.links_since(before, opts.nbytes, 1, f"clean fetch {run_ + 1}"))
            clean.append(span([got]))
            used = add_reads(used, reads([got]))
        t_clean = statistics.median(clean)
        before = c.link_bytes()
        reader.send("tfetch", sources=sources, **fetch)
        time.sleep(t_clean / 2)
        holders[0].kill()  # the first-ranked source: busy until the end
        got = reader.reply(300)
        verify(served[0]["digest"], [got], "fetch with a killed holder")
        links.append(c.links_since(before, opts.nbytes, 1, "fetch with a killed holder"))
        used = add_reads(used, reads([got]))
        t_fail = span([got])
        ucx = c.ucx()
    refetched = got["refetched_bytes"] + got["discarded_bytes"]
    received = sum(got["bytes_per_source"].values())
    bound = DETECTION + refetched / opts.rate_Bps
    extra = t_fail - t_clean
    res.add("extra time / (detection + re-fetch time)", max(extra, 0.0) / bound, "<= 1")
    # Each chunk is completed exactly once; only chunks cut mid-way by the kill are received
    # again: over TCP at most one per connection to the killed holder (a GET streams chunk by
    # chunk), over NIXL the READs a connection has posted (`_in_flight`).
    in_flight = math.ceil(PARALLEL / len(sources)) * _in_flight(opts)
    res.add("chunk bytes completed / model", received / opts.nbytes, "<= 1.0")
    res.add("re-fetched / chunks in flight at the kill", refetched / in_flight, "<= 1")
    res.add("re-fetched", refetched / 1024, unit="KiB")
    res.add("extra time", extra, unit="s")
    transport_figures(res, opts.transport, min(m.per_copy for m in links), used, "reader")
    res.details = {
        "saturation": sat.to_dict(),
        "clean_s": clean,
        "failed_s": t_fail,
        "refetched_bytes": got["refetched_bytes"],
        "discarded_bytes": got["discarded_bytes"],
        "bytes_per_source": got["bytes_per_source"],
        "failed_sources": got["failed_sources"],
        "bound_s": bound,
        "transport": opts.transport,
        "ucx": ucx,
        "nixl_warmup_s": warmup,
        "reads": used,
        "transports": got["transports"],
        "links": [m.to_dict() for m in links],
    }
    if not got["failed_sources"]:
        res.note = "the killed holder was not seen to fail (the fetch ended before the kill)"
    if not sat.saturated:
        res.withhold(f"a plain socket reached only {sat.fraction:.0%} of the link rate")
    res.seconds = time.monotonic() - started
    return res
