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

`--plot FILE.png` (`plot`) draws T(N) against N for the three, from the result's details.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from bench.common import MODEL, Options, span, verify
from bench.emu.cluster import Cluster, settle
from bench.emu.control import broadcast, gather
from bench.report import Result

READERS = (1, 2, 4, 8)
SERIES = {  # the plot's lines: label -> key of `Result.details`
    "TensorHub": "tensorhub_T",
    "parameter server": "param_server_T",
    "gloo broadcast": "gloo_T",
}


def steps(readers: tuple[int, ...] = READERS) -> int:
    """How many measurements a run makes (for a progress bar): each pattern at each N."""
    return len(SERIES) * len(readers)


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
    with Cluster({1: 1 + most}, opts.rate_mbit) as c:
        trainer, pool = c.parts[0], c.parts[1:]
        sat = c.saturation(c.parts, opts.nbytes)
        one = sat.one_transfer
        th: dict[int, float] = {}
        stall: dict[int, float] = {}
        for version, n in enumerate(readers, start=1):
            pub = trainer.call("publish", model=MODEL, version=version, nbytes=opts.nbytes,
                               seed=opts.seed, chunk=opts.chunk)  # fmt: skip
            trainer.send("wait", version=version, k=1)
            got = broadcast(pool[:n], "fetch", 300, model=MODEL, version=version)
            waited = trainer.reply(300)
            verify(pub["digest"], got, f"tensorhub N={n}")
            th[n] = span(got, pub["t0"])
            stall[n] = waited["t1"] - waited["t0"]
            broadcast(pool[:n], "release", 60, version=version)
            done(f"TensorHub N={n}: {th[n]:.2f}s")
            settle()
        served = trainer.call("serve", nbytes=opts.nbytes, seed=opts.seed, chunk=opts.chunk)
        source = [["trainer", trainer.host.ip, served["port"]]]
        ps: dict[int, float] = {}
        for n in readers:
            got = broadcast(pool[:n], "tfetch", 600, sources=source, nbytes=opts.nbytes,
                            chunk=opts.chunk)  # fmt: skip
            verify(served["digest"], got, f"parameter-server N={n}")
            ps[n] = span(got)
            done(f"parameter server N={n}: {ps[n]:.2f}s")
            settle()
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
    lo, hi = min(readers), most
    res.add(f"TensorHub T({hi})/T({lo})", th[hi] / th[lo], "<= 1.3")
    res.add("TensorHub max stall / one transfer", max(stall.values()) / one, "<= 1.2")
    res.add(f"param-server T({hi})/T({lo})", ps[hi] / ps[lo])
    res.add(f"gloo broadcast T({hi})/T({lo})", gl[hi] / gl[lo])
    res.add(f"param-server T({hi}) / TensorHub T({hi})", ps[hi] / th[hi])
    res.add(f"gloo T({hi}) / TensorHub T({hi})", gl[hi] / th[hi])
    res.add(f"param-server stall({hi}) / TensorHub stall({hi})", ps[hi] / stall[hi])
    res.add("one transfer (plain socket)", one, unit="s")
    res.details = {
        "saturation": sat.to_dict(),
        "tensorhub_T": th,
        "tensorhub_stall": stall,
        "param_server_T": ps,
        "gloo_T": gl,
        "bytes": opts.nbytes,
    }
    if not sat.saturated:
        res.withhold(f"a plain socket reached only {sat.fraction:.0%} of the link rate")
    res.seconds = time.monotonic() - started
    return res


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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = series(result.details)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (label, points), marker in zip(lines.items(), "os^", strict=False):
        ax.plot(list(points), list(points.values()), marker=marker, label=label)
    ax.set_xlabel("readers")
    ax.set_ylabel("seconds until every reader has the model")
    ax.set_xticks(sorted({n for points in lines.values() for n in points}))
    ax.set_ylim(bottom=0)
    nbytes = result.details.get("bytes", 0)
    ax.set_title(f"tensorhub bench fanout: {nbytes / (1 << 20):.0f} MiB model, one trainer")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    text = json.dumps({label: {str(n): t for n, t in p.items()} for label, p in lines.items()})
    fig.savefig(path, format="png", metadata={"tensorhub-series": text})
    plt.close(fig)
    return lines
