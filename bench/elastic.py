"""`tensorhub bench elastic`: 4 rollouts already hold the version; 4 new ones join at once.

TensorHub: the joiners fetch with the SDK; each reads from a holder chosen by the real
pipeline policy (`transport.planner.pipeline_sources`: joiner p reads from the p-th newest
complete holder), so the four complete rollouts serve the four joiners in parallel.
Baseline: the joiners pull from the trainer (the only source a trainer-centric system has).
Figure: baseline time / TensorHub time for all joiners to be done (target >= 3).

`--transport nixl`: every client reads COMPLETE holders over NIXL (UCX over TCP on each
host's veth), so the joiners read the four rollouts over NIXL, and the baseline's joiners
pull from a bare NIXL holder on the trainer. The holders' fetch, the joiners' and the
baseline's each check the host links' byte counters against their 4 copies
(`LinksBypassed`); the joiners' reads are counted by transport (`reads`).
"""

from __future__ import annotations

import time

from bench.common import MODEL, Options, reads, span, transport_figures, verify
from bench.emu.cluster import Cluster, settle
from bench.emu.control import broadcast
from bench.report import Result

HOLDERS = 4
JOINERS = 4


def run(opts: Options) -> Result:
    res = Result("elastic", "tensorhub bench elastic" + opts.flags())
    started = time.monotonic()
    with Cluster({1: 1 + HOLDERS + JOINERS}, opts.rate_mbit, transport=opts.transport) as c:
        trainer, old, new = c.parts[0], c.parts[1 : 1 + HOLDERS], c.parts[1 + HOLDERS :]
        sat = c.saturation(c.parts, opts.nbytes)
        before = c.link_bytes()
        pub = trainer.call("publish", model=MODEL, version=1, nbytes=opts.nbytes,
                           seed=opts.seed, chunk=opts.chunk)  # fmt: skip
        first = broadcast(old, "fetch", 300, model=MODEL, version=1)
        verify(pub["digest"], first, "holders")
        links = {"holders": c.links_since(before, opts.nbytes, HOLDERS, "holders")}
        settle()
        before = c.link_bytes()
        got = broadcast(new, "fetch", 300, model=MODEL, version=1)
        verify(pub["digest"], got, "tensorhub joiners")
        links["joiners"] = c.links_since(before, opts.nbytes, JOINERS, "tensorhub joiners")
        th = span(got)
        used = {"holders": reads(first), "joiners": reads(got)}
        settle()
        served = trainer.call("serve", nbytes=opts.nbytes, seed=opts.seed, chunk=opts.chunk,
                              transport=opts.transport)  # fmt: skip
        source = [["trainer", trainer.host.ip, served["port"]]]
        before = c.link_bytes()
        got = broadcast(new, "tfetch", 600, sources=source, nbytes=opts.nbytes,
                        chunk=opts.chunk, transport=opts.transport)  # fmt: skip
        verify(served["digest"], got, "pull-from-trainer joiners")
        what = "pull-from-trainer joiners"
        links["pull_from_trainer"] = c.links_since(before, opts.nbytes, JOINERS, what)
        pull = span(got)
        ucx = c.ucx()
    res.add("pull-from-trainer / TensorHub (joiners done)", pull / th, ">= 3")
    res.add("TensorHub joiners done / one transfer", th / sat.one_transfer)
    res.add("TensorHub joiners done", th, unit="s")
    lowest = min(m.per_copy for m in links.values())
    transport_figures(res, opts.transport, lowest, used["joiners"], "TensorHub joiners'")
    res.details = {
        "saturation": sat.to_dict(),
        "tensorhub_s": th,
        "pull_from_trainer_s": pull,
        "transport": opts.transport,
        "ucx": ucx,
        "tensorhub_reads": used,
        "links": {k: m.to_dict() for k, m in links.items()},
    }
    if not sat.saturated:
        res.withhold(f"a plain socket reached only {sat.fraction:.0%} of the link rate")
    res.seconds = time.monotonic() - started
    return res
