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

Delta versions: the trainer then trains the transformer of `bench delta` (69.3 MiB in bf16,
`bench.emu.training.DEFAULT`, the same seeds) at lr 1e-6 for `DELTA_STEPS` steps itself,
publishing version 1 (the initial weights) and every step with `delta=True`; the 8 readers
fetch version 1 whole and each step into their previous tensors. The bytes the router sent
into dc2 during each step (publish to the last reader done) over the model's bytes is the
delta row (target <= 0.05). The versions are trained here rather than read from files a
`bench delta` run recorded, so that `bench crossdc` stands alone (and `bench all` runs it
first); they are the same versions, bit for bit (CPU training in one thread is deterministic
for its seeds: the digests are in the details, `delta_digests`, to compare with `bench
delta`'s lr 1e-6 steps). Without transformers (a dev extra) the row has no value.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from bench.common import MODEL, Options, span, verify
from bench.emu import training
from bench.emu.cluster import Cluster, settle
from bench.emu.control import Participant, broadcast
from bench.report import Result

READERS = 8
WAN_SLOWER = 5.0
DELTA_LR = 1e-6
DELTA_STEPS = 3
DELTA_MODEL = "delta-lr1e-06"
DELTA_ROW = "TensorHub WAN bytes per step / model (delta, lr 1e-6)"


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
        settle()
        deltas = _deltas(c, trainer, pool, opts.chunk)
    model_bytes = opts.nbytes
    res.add("TensorHub WAN bytes / model", crossed / model_bytes, "<= 1.05")
    res.add("pull-across stall / TensorHub stall", base / th_stall, ">= 5")
    res.add("pull-across WAN bytes / model", crossed_base / model_bytes)
    res.add("pull-across all done / TensorHub all done", base / th_done)
    res.add("TensorHub stall", th_stall, unit="s")
    res.add(DELTA_ROW, deltas.get("wan_per_model"), "<= 0.05")
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
        "delta": deltas,
    }
    if not (sat.saturated and wsat.saturated):
        res.withhold(
            f"plain sockets reached {sat.fraction:.0%} (hosts) and {wsat.fraction:.0%} (WAN)"
        )
    res.seconds = time.monotonic() - started
    return res


def _deltas(
    c: Cluster, trainer: Participant, pool: list[Participant], chunk: int
) -> dict[str, Any]:
    """The delta phase (module docstring): WAN bytes per step over the model's bytes."""
    if why := training.missing():
        return {"not_run": why}
    spec = training.DEFAULT
    pub = trainer.call("train_init", 600, model=DELTA_MODEL, spec=spec.to_dict(), lr=DELTA_LR,
                       chunk=chunk)  # fmt: skip
    got = broadcast(pool, "fetch_into", 900, model=DELTA_MODEL, version=1)
    verify(pub["digest"], got, "delta version 1")
    digests, crossed, applied = [pub["digest"]], [], []
    for version in range(2, DELTA_STEPS + 2):
        settle()
        before = c.emu.wan_tx_bytes(2)
        pub = trainer.call("train_step", 600, model=DELTA_MODEL, version=version, chunk=chunk)
        got = broadcast(pool, "fetch_into", 600, model=DELTA_MODEL, version=version)
        crossed.append(c.emu.wan_tx_bytes(2) - before)
        verify(pub["digest"], got, f"delta version {version}")
        digests.append(pub["digest"])
        applied.append(sum(1 for r in got if r.get("delta") and r["delta"]["chunks"]))
    broadcast([trainer, *pool], "drop", 60)
    return {
        "wan_per_model": statistics.fmean(crossed) / spec.nbytes,
        "wan_bytes_per_step": crossed,
        "readers_that_applied_a_delta": applied,
        "model_bytes": spec.nbytes,
        "lr": DELTA_LR,
        "delta_digests": digests,
    }
