"""`tensorhub bench elastic`: 4 rollouts already hold the version; 4 new ones join at once.

TensorHub: the joiners fetch with the SDK; each reads from a holder chosen by the real
pipeline policy (`transport.planner.pipeline_sources`: joiner p reads from the p-th newest
complete holder), so the four complete rollouts serve the four joiners in parallel.
Baseline: the joiners pull from the trainer (the only source a trainer-centric system has).
Figure: baseline time / TensorHub time for all joiners to be done (target >= 3).
"""

from __future__ import annotations

import time

from bench.common import MODEL, Options, span, verify
from bench.emu.cluster import Cluster, settle
from bench.emu.control import broadcast
from bench.report import Result

HOLDERS = 4
JOINERS = 4


def run(opts: Options) -> Result:
    res = Result("elastic", "tensorhub bench elastic" + opts.flags())
    started = time.monotonic()
    with Cluster({1: 1 + HOLDERS + JOINERS}, opts.rate_mbit) as c:
        trainer, old, new = c.parts[0], c.parts[1 : 1 + HOLDERS], c.parts[1 + HOLDERS :]
        sat = c.saturation(c.parts, opts.nbytes)
        pub = trainer.call("publish", model=MODEL, version=1, nbytes=opts.nbytes,
                           seed=opts.seed, chunk=opts.chunk)  # fmt: skip
        verify(pub["digest"], broadcast(old, "fetch", 300, model=MODEL, version=1), "holders")
        settle()
        got = broadcast(new, "fetch", 300, model=MODEL, version=1)
        verify(pub["digest"], got, "tensorhub joiners")
        th = span(got)
        settle()
        served = trainer.call("serve", nbytes=opts.nbytes, seed=opts.seed, chunk=opts.chunk)
        source = [["trainer", trainer.host.ip, served["port"]]]
        got = broadcast(new, "tfetch", 600, sources=source, nbytes=opts.nbytes, chunk=opts.chunk)
        verify(served["digest"], got, "pull-from-trainer joiners")
        pull = span(got)
    res.add("pull-from-trainer / TensorHub (joiners done)", pull / th, ">= 3")
    res.add("TensorHub joiners done / one transfer", th / sat.one_transfer)
    res.add("TensorHub joiners done", th, unit="s")
    res.details = {"saturation": sat.to_dict(), "tensorhub_s": th, "pull_from_trainer_s": pull}
    if not sat.saturated:
        res.withhold(f"a plain socket reached only {sat.fraction:.0%} of the link rate")
    res.seconds = time.monotonic() - started
    return res
