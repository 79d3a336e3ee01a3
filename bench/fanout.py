"""`tensorhub bench fanout`: one trainer, N in {1, 2, 4, 8} readers, every link shaped.

Per N, in one run on the same emulated hosts:
- TensorHub: the trainer publishes with the SDK and waits in `wait_replicated(1)` (its
  stall); the readers fetch with the SDK at once, each becoming a PARTIAL holder that
  serves the chunks it has (pipelined replication). T(N): publish start to the last reader
  done.
- parameter-server pattern: every reader pulls the whole model from the trainer (the same
  transport code, the trainer as the only source); the trainer cannot release until the
  last reader is done, so its stall is T(N).
- `torch.distributed` broadcast (gloo) from the trainer, group of N + 1 (group set-up not
  counted).
Targets: TensorHub T(8)/T(1) <= 1.3; trainer stall <= 1.2x one plain-socket transfer of
the model on one link, for every N.

Then a trainer of `fanout_ranks.RANKS` ranks (processes on the trainer's host, one gloo
group) publishes the model as one shard per rank, step after step, through the group path
(one PublishShards call per version) and through one Publish call per rank, alternately:
the trainer's stall per step in each (`bench.fanout_ranks`), its medians reported and every
step's in `details["trainer_ranks"]`.

`--transport nixl`: the clients read COMPLETE holders over NIXL (UCX over TCP on each host's
veth; the first reader reads the trainer so, the readers behind it, PARTIAL when planned,
over TCP), and the parameter-server readers pull from a bare NIXL holder on the trainer.
Every TensorHub and parameter-server phase checks the host links' byte counters against
its N copies (`LinksBypassed`), and the reads are counted by transport (`reads`). Before
the measured versions a NIXL run warms up, as gloo's group set-up is not counted: the
trainer publishes a `warmup` model and the readers fetch it one after another, so each
reads a COMPLETE holder over NIXL once and has paid NIXL's one-time costs in its process
(its agent, a UCX context: about 0.4 s; the UCX connections); those fetches' times are in
`details["nixl_warmup"]`.

`--plot FILE.png` (`plot`) draws T(N) against N for the three, from the result's details.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from bench import fanout_ranks
from bench.common import MODEL, Options, add_reads, reads, span, transport_figures, verify
from bench.emu.cluster import Cluster, Links, settle
from bench.emu.control import Participant, broadcast, gather
from bench.plots import line_chart
from bench.report import Result

READERS = (1, 2, 4, 8)
WARMUP = "warmup"  # the model a NIXL run's warm-up fetches (`_warm_up`)
SERIES = {  # the plot's lines: label -> key of `Result.details`
    "TensorHub": "tensorhub_T",
    "parameter server": "param_server_T",
    "gloo broadcast": "gloo_T",
}


def steps(readers: tuple[int, ...] = READERS) -> int:
    """How many measurements a run makes (for a progress bar): each pattern at each N, and
    the trainer ranks' stall in each mode."""
    return len(SERIES) * len(readers) + len(fanout_ranks.MODES)


def run(
    opts: Options,
    readers: tuple[int, ...] = READERS,
    progress: Callable[[str], None] | None = None,
) -> Result:
    """The run (see the module docstring); `progress(what)` after each measurement."""
    res = Result("fanout", "tensorhub bench fanout" + opts.flags())
    done = progress or (lambda what: None)
    most = max(readers)
    started = time.monotonic()
    with Cluster({1: 1 + most}, opts.rate_mbit, transport=opts.transport) as c:
        trainer, pool = c.parts[0], c.parts[1:]
        sat = c.saturation(c.parts, opts.nbytes)
        one = sat.one_transfer
        th: dict[int, float] = {}
        stall: dict[int, float] = {}
        links: dict[str, dict[int, Links]] = {"tensorhub": {}, "param_server": {}}
        used: dict[int, dict[str, int]] = {}
        warmup = _warm_up(opts, trainer, pool) if opts.transport == "nixl" else []
        for version, n in enumerate(readers, start=1):
            before = c.link_bytes()
            pub = trainer.call("publish", model=MODEL, version=version, nbytes=opts.nbytes,
                               seed=opts.seed, chunk=opts.chunk)  # fmt: skip
            trainer.send("wait", version=version, k=1)
            got = broadcast(pool[:n], "fetch", 300, model=MODEL, version=version)
            waited = trainer.reply(300)
            verify(pub["digest"], got, f"tensorhub N={n}")
            links["tensorhub"][n] = c.links_since(before, opts.nbytes, n, f"tensorhub N={n}")
            th[n] = span(got, pub["t0"])
            stall[n] = waited["t1"] - waited["t0"]
            used[n] = reads(got)
            broadcast(pool[:n], "release", 60, version=version)
            done(f"TensorHub N={n}: {th[n]:.2f}s")
            settle()
        served = trainer.call("serve", nbytes=opts.nbytes, seed=opts.seed, chunk=opts.chunk,
                              transport=opts.transport)  # fmt: skip
        source = [["trainer", trainer.host.ip, served["port"]]]
        ps: dict[int, float] = {}
        for n in readers:
            before = c.link_bytes()
            got = broadcast(pool[:n], "tfetch", 600, sources=source, nbytes=opts.nbytes,
                            chunk=opts.chunk, transport=opts.transport)  # fmt: skip
            verify(served["digest"], got, f"parameter-server N={n}")
            what = f"parameter-server N={n}"
            links["param_server"][n] = c.links_since(before, opts.nbytes, n, what)
            ps[n] = span(got)
            done(f"parameter server N={n}: {ps[n]:.2f}s")
            settle()
        ucx = c.ucx()
        gl: dict[int, float] = {}
        for n in readers:
            group = [trainer, *pool[:n]]
            for rank, p in enumerate(group):
                p.send("gloo", master=trainer.host.ip, port=29400 + n, rank=rank,
                       world=n + 1, nbytes=opts.nbytes, seed=opts.seed)  # fmt: skip
            got = gather(group, 600)
            verify(got[0]["digest"], got[1:], f"gloo N={n}")
            gl[n] = span(got)
            done(f"gloo N={n}: {gl[n]:.2f}s")
            settle()
        ranks = fanout_ranks.measure(c, opts, progress=done)
    lo, hi = min(readers), most
    res.add(f"TensorHub T({hi})/T({lo})", th[hi] / th[lo], "<= 1.3")
    res.add("TensorHub max stall / one transfer", max(stall.values()) / one, "<= 1.2")
    res.add(f"param-server T({hi})/T({lo})", ps[hi] / ps[lo])
    res.add(f"gloo broadcast T({hi})/T({lo})", gl[hi] / gl[lo])
    res.add(f"param-server T({hi}) / TensorHub T({hi})", ps[hi] / th[hi])
    res.add(f"gloo T({hi}) / TensorHub T({hi})", gl[hi] / th[hi])
    res.add(f"param-server stall({hi}) / TensorHub stall({hi})", ps[hi] / stall[hi])
    res.add("one transfer (plain socket)", one, unit="s")
    r, median = ranks["ranks"], ranks["median_s"]
    res.add(f"trainer stall per step, {r} ranks, group publish", median["group"], unit="s")
    res.add(f"trainer stall per step, {r} ranks, one call per rank", median["per_rank"], unit="s")
    res.add(f"stall per step, one call per rank / group ({r} ranks)",
            median["per_rank"] / median["group"])  # fmt: skip
    total: dict[str, int] = {}
    for counted in used.values():
        total = add_reads(total, counted)
    lowest = min(m.per_copy for phase in links.values() for m in phase.values())
    transport_figures(res, opts.transport, lowest, total)
    res.details = {
        "saturation": sat.to_dict(),
        "tensorhub_T": th,
        "tensorhub_stall": stall,
        "param_server_T": ps,
        "gloo_T": gl,
        "bytes": opts.nbytes,
        "transport": opts.transport,
        "ucx": ucx,
        "tensorhub_reads": used,
        "nixl_warmup": warmup,
        "trainer_ranks": ranks,
        "links": {k: {n: m.to_dict() for n, m in v.items()} for k, v in links.items()},
    }
    if not sat.saturated:
        res.withhold(f"a plain socket reached only {sat.fraction:.0%} of the link rate")
    res.seconds = time.monotonic() - started
    return res


def _warm_up(opts: Options, trainer: Participant, pool: list[Participant]) -> list[Any]:
    """Each reader fetches a `warmup` model in turn, every holder before it COMPLETE, so
    each reads over NIXL once (module docstring); then everyone releases it. Returns each
    fetch's seconds and reads."""
    pub = trainer.call("publish", model=WARMUP, version=1, nbytes=opts.nbytes,
                       seed=opts.seed, chunk=opts.chunk)  # fmt: skip
    out = []
    for p in pool:
        got = p.call("fetch", 300, model=WARMUP, version=1)
        verify(pub["digest"], [got], f"warm-up on {p.host.name}")
        out.append({"host": p.host.name, "s": round(span([got]), 3), "reads": reads([got])})
    broadcast([trainer, *pool], "release", 60, version=1)
    settle()
    return out


def series(details: Mapping[str, Any]) -> dict[str, dict[int, float]]:
    """Seconds by number of readers for each line of the plot (keys may be strings after a
    JSON round trip)."""
    return {
        label: {
            int(n): float(t) for n, t in sorted(details[key].items(), key=lambda kv: int(kv[0]))
        }
        for label, key in SERIES.items()
        if details.get(key)
    }


def plot(result: Result, path: Path) -> dict[str, dict[int, float]]:
    """T(N) against N for TensorHub and each baseline, as a PNG at `path` (matplotlib); the
    series drawn are also stored in the PNG's text (key `tensorhub-series`) and returned."""
    lines = series(result.details)
    nbytes = result.details.get("bytes", 0)
    line_chart(
        path,
        lines,
        xlabel="readers",
        ylabel="seconds until every reader has the model",
        title=f"tensorhub bench fanout: {nbytes / (1 << 20):.0f} MiB model, one trainer",
    )
    return lines
