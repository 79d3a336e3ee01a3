"""`tensorhub bench crossdc`: trainer in dc1, 8 readers in dc2, the inter-dc link 5x slower.

TensorHub: the readers fetch with the SDK. The pipeline policy ranks holders by topology,
so the first reader of dc2 to register (the dc's seed, by registration order) is the only
one that reads across the WAN, though all 8 start at once; the others chain behind it inside
dc2 (no seed election: docs/design-notes.md, "The cross-dc seed"). Bytes that cross are
read from the router's interface counter (frames included). The trainer's stall is its
`wait_replicated(1)`: once one copy is in dc2, it may release.
Baseline: every reader pulls across the WAN from the trainer, which must serve until the
last one is done.
Targets: WAN bytes per version <= 1.05x the model; baseline stall / TensorHub stall >= 5.
(No netem here: the inter-dc link differs in rate only, with no added latency.)
"""

from __future__ import annotations

import time

from bench.common import MODEL, Options, span, verify
from bench.emu.cluster import Cluster, settle
from bench.emu.control import broadcast
from bench.report import Result

READERS = 8
WAN_SLOWER = 5.0


def run(opts: Options) -> Result:
    res = Result("crossdc", "tensorhub bench crossdc" + opts.flags())
    started = time.monotonic()
    wan = opts.rate_mbit / WAN_SLOWER
    with Cluster({1: 1, 2: READERS}, opts.rate_mbit, wan) as c:
        trainer, pool = c.parts[0], c.parts[1:]
        sat = c.saturation(pool, opts.nbytes)
        wsat = c.wan_saturation(trainer, pool[0], opts.nbytes // 4)
        pub = trainer.call("publish", model=MODEL, version=1, nbytes=opts.nbytes,
                           seed=opts.seed, chunk=opts.chunk)  # fmt: skip
        before = c.emu.wan_tx_bytes(2)
        trainer.send("wait", version=1, k=1)
        got = broadcast(pool, "fetch", 600, model=MODEL, version=1)
        waited = trainer.reply(600)
        crossed = c.emu.wan_tx_bytes(2) - before
        verify(pub["digest"], got, "tensorhub readers")
        th_done = span(got, pub["t0"])
        th_stall = waited["t1"] - waited["t0"]
        broadcast(pool, "release", 60, version=1)
        settle()
        served = trainer.call("serve", nbytes=opts.nbytes, seed=opts.seed, chunk=opts.chunk)
        source = [["trainer", trainer.host.ip, served["port"]]]
        before = c.emu.wan_tx_bytes(2)
        # 8 readers x 4 connections share the 40 Mbit/s WAN: ~150 KB/s each, under the reader's
        # rate floor, which would suspect the baseline's only source; the pull is measured plain
        got = broadcast(pool, "tfetch", 900, sources=source, nbytes=opts.nbytes,
                        chunk=opts.chunk, rate_floor=0.0)  # fmt: skip
        crossed_base = c.emu.wan_tx_bytes(2) - before
        verify(served["digest"], got, "pull-across readers")
        base = span(got)
    model_bytes = opts.nbytes
    res.add("TensorHub WAN bytes / model", crossed / model_bytes, "<= 1.05")
    res.add("pull-across stall / TensorHub stall", base / th_stall, ">= 5")
    res.add("pull-across WAN bytes / model", crossed_base / model_bytes)
    res.add("pull-across all done / TensorHub all done", base / th_done)
    res.add("TensorHub stall", th_stall, unit="s")
    res.details = {
        "saturation": sat.to_dict(),
        "wan_saturation": wsat.to_dict(),
        "wan_mbit": wan,
        "tensorhub_stall_s": th_stall,
        "tensorhub_all_done_s": th_done,
        "pull_across_s": base,
        "wan_bytes_tensorhub": crossed,
        "wan_bytes_pull_across": crossed_base,
        "model_bytes": model_bytes,
    }
    if not (sat.saturated and wsat.saturated):
        res.withhold(
            f"plain sockets reached {sat.fraction:.0%} (hosts) and {wsat.fraction:.0%} (WAN)"
        )
    res.seconds = time.monotonic() - started
    return res
