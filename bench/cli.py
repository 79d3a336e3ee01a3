"""`tensorhub bench NAME|all`: benchmarks side by side with their baselines.

`transport` is the existing loopback benchmark (`bench.transport.main`, its own flags);
`fanout`, `elastic`, `crossdc`, `failover` and `metadata` run on emulated hosts (root
needed); `gpu` is the GPU memory paths (`bench.gpu`, its own flags; needs a CUDA device);
`sim` is the cluster-scale simulator (`bench.sim.cli`); `scale` is the scale
envelope on loopback (`bench.scale.cli`, its own flags); `all` runs every emulated benchmark,
a shortened `transport` and a shortened `scale` in sequence and writes one JSON report.
Human table by default; `--json PATH` writes the figures (`-` for stdout).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from bench import crossdc, elastic, failover, fanout, metadata
from bench.common import Options, add_options, options
from bench.emu.netns import NeedsRoot
from bench.report import Result, table

EMULATED: dict[str, Callable[[Options], Result]] = {
    "fanout": fanout.run,
    "elastic": elastic.run,
    "crossdc": crossdc.run,
    "failover": failover.run,
    "metadata": metadata.run,
}
CROSSDC_MB = 16  # the inter-dc link is 5x slower: a smaller model keeps the run short
ALL_TRANSPORT = ["--size-mb", "256", "--repeat", "2"]
# `bench all` keeps scale to a few minutes: the two ends of the clients sweep, a shorter history
# `bench all` runs the scale parts it always ran; the herd and the replica kill under 2,000
# SDK clients are `bench scale --parts herd` and `--parts reconnect` (minutes each).
ALL_SCALE = ["--parts", "clients,holders,manifest,history,shards",
             "--clients", "100,2000", "--history-steps", "3000", "--history-seconds", "120",
             "--history-sample-every", "250"]  # fmt: skip
NAMES = [*EMULATED, "transport", "sim", "scale", "gpu", "all"]


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    parser.add_argument("name", choices=NAMES, help="which benchmark (or all)")
    parser.add_argument("rest", nargs=argparse.REMAINDER, help="the benchmark's own flags")


def _parse(name: str, rest: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=f"tensorhub bench {name}")
    add_options(ap, CROSSDC_MB if name == "crossdc" else 32)
    ap.add_argument("--json", metavar="PATH", help="write the figures as JSON (- = stdout)")
    return ap.parse_args(rest)


def _transport(extra: list[str]) -> Result:
    """The transport benchmark with `extra` flags (its figures and targets are its own)."""
    from bench import transport

    return transport.run(
        transport.parser().parse_args(extra), " ".join(["tensorhub bench transport", *extra])
    )


def _emit(results: list[Result], path: str | None) -> None:
    print(table(results))
    if path:
        report = {
            "generated_unix": time.time(),
            "ok": all(r.ok for r in results),
            "results": [r.to_dict() for r in results],
        }
        text = json.dumps(report, indent=2, default=str)
        if path == "-":
            print(text)
        else:
            Path(path).write_text(text)


def run(args: argparse.Namespace) -> int:
    name, rest = args.name, list(args.rest)
    if name == "transport":
        from bench import transport

        return transport.main(rest)
    if name == "gpu":
        from bench import gpu

        return gpu.main(rest)
    if name == "sim":
        from bench.sim import cli as sim_cli

        return sim_cli.main(rest)
    if name == "scale":
        from bench.scale import cli as scale_cli

        return scale_cli.main(rest)
    opts_ns = _parse(name, rest)
    if os.geteuid() != 0:
        print(f"tensorhub bench {name}: {NeedsRoot.__doc__}", file=sys.stderr)
        return 2
    opts = options(opts_ns)
    if name != "all":
        _emit([EMULATED[name](opts)], opts_ns.json)
        return 0
    results: list[Result] = []
    for bench_name, fn in EMULATED.items():
        each = opts if bench_name != "crossdc" else Options(opts.rate_mbit, CROSSDC_MB,
                                                            opts.chunk_kb)  # fmt: skip
        print(f"== {bench_name} ...", file=sys.stderr, flush=True)
        results.append(fn(each))
    print("== transport ...", file=sys.stderr, flush=True)
    results.append(_transport(ALL_TRANSPORT))
    from bench.scale import cli as scale_cli

    results.extend(scale_cli.results(scale_cli.parse(ALL_SCALE)))
    _emit(results, opts_ns.json)
    return 0 if all(r.ok for r in results) else 1
