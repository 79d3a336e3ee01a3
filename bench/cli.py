"""`tensorhub bench NAME|all`: benchmarks side by side with their baselines.

`transport` is the existing loopback benchmark (`bench.transport.main`, its own flags);
`fanout`, `elastic`, `crossdc`, `failover`, `metadata` and `delta` run on emulated hosts
(root needed; `delta` trains a real transformer: it needs transformers, a dev extra); `gpu`
is the GPU memory paths (`bench.gpu`, its own flags; needs a CUDA device);
`reshard` is rollouts in vLLM's TP-2 layout reading their blocks from a TP-4 trainer
(`bench.reshard`, emulated hosts; not in `all`: its targets need readers that start
together to read from each other, which they do not);
`sim` is the cluster-scale simulator (`bench.sim.cli`); `scale` is the scale
envelope on loopback (`bench.scale.cli`, its own flags); `views` is what quantizing a view
costs its publisher (`bench.views`, its own flags); `watches` is a hostile tenant's Watch
streams on many model names (`bench.hostile`, its own flags); `all` runs every emulated
benchmark, a shortened `transport` and a shortened `scale` in sequence and writes one JSON
report.
`fanout`, `elastic` and `failover` take `--transport {tcp,nixl}` (default tcp; `all` runs
them over TCP). Human table by default; `--json PATH` writes the figures (`-` for stdout).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

from bench import crossdc, delta, elastic, failover, fanout, metadata, reshard
from bench.common import Options, add_options, add_transport, options
from bench.emu.netns import NeedsRoot
from bench.report import Result, emit
from ros.cli.progress import Bar
from ros.demo.summary import matplotlib_missing
from tensorhub.errors import InvalidArgument

EMULATED: dict[str, Callable[[Options], Result]] = {
    "fanout": fanout.run,
    "elastic": elastic.run,
    "crossdc": crossdc.run,
    "failover": failover.run,
    "metadata": metadata.run,
    "delta": delta.run,
}
TRANSPORT_BENCHES = ("fanout", "elastic", "failover")  # those that take `--transport`
CROSSDC_MB = 16  # the inter-dc link is 5x slower: a smaller model keeps the run short
ALL_TRANSPORT = ["--size-mb", "256", "--repeat", "2"]
# `bench all` keeps scale to a few minutes: the two ends of the clients sweep, a shorter
# history, and the scale parts it always ran (the herd and the replica kill under 2,000 SDK
# clients are `bench scale --parts herd` and `--parts reconnect`, minutes each).
ALL_SCALE = ["--parts", "clients,holders,manifest,history,shards",
             "--clients", "100,2000", "--history-steps", "3000", "--history-seconds", "120",
             "--history-sample-every", "250"]  # fmt: skip
PLOTS = {  # the benchmarks that draw `--plot FILE.png`, and what
    "fanout": "draw the time until every reader has the model against the number of readers, "
    "for TensorHub and each baseline (matplotlib)",
    "delta": "draw the wire bytes per step against the step, one line per learning rate "
    "(matplotlib)",
    "reshard": "draw T (publish to the last worker verified) against the number of rollout "
    "instances, for readers that hold their blocks and readers that hold nothing (matplotlib)",
}
NAMES = [
    *EMULATED,
    "reshard",
    "transport",
    "sim",
    "scale",
    "gpu",
    "views",
    "watches",
    "all",
]


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    parser.add_argument("name", choices=NAMES, help="which benchmark (or all)")
    parser.add_argument("rest", nargs=argparse.REMAINDER, help="the benchmark's own flags")


def _parse(name: str, rest: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=f"tensorhub bench {name}")
    if name == "delta":
        delta.add_arguments(ap)
    elif name == "reshard":
        reshard.add_arguments(ap)
    else:
        add_options(ap, CROSSDC_MB if name == "crossdc" else 32)
    ap.add_argument("--json", metavar="PATH", help="write the figures as JSON (- = stdout)")
    if name in TRANSPORT_BENCHES:
        add_transport(ap)
    if name in PLOTS:
        ap.add_argument("--plot", type=Path, metavar="FILE.png", help=PLOTS[name])
    return ap.parse_args(rest)


def _one(name: str, opts: Options, plot_to: Path | None, cfg: delta.Config | None) -> Result:
    """One emulated benchmark under a progress bar (fanout, delta: one step per measurement),
    and its plot when asked."""
    if name == "delta":
        return _delta(opts, plot_to, cfg or delta.Config())
    if name != "fanout":
        with Bar(1, f"bench {name}", unit="run") as bar:
            result = EMULATED[name](opts)
            bar.advance(1)
        return result
    with Bar(fanout.steps(), "bench fanout", unit="run") as bar:

        def step(what: str) -> None:
            bar.write(what)
            bar.advance(1)

        result = fanout.run(opts, progress=step)
    if plot_to is not None:
        fanout.plot(result, plot_to)
        print(f"plot written to {plot_to}", file=sys.stderr)
    return result


def _delta(opts: Options, plot_to: Path | None, cfg: delta.Config) -> Result:
    return _stepped(
        "bench delta", "run", delta.steps(cfg),
        lambda progress: delta.run(opts, cfg, progress=progress), delta.plot, plot_to,
    )  # fmt: skip


def _reshard(opts: Options, plot_to: Path | None, cfg: reshard.Config) -> Result:
    return _stepped(
        "bench reshard", "step", reshard.steps(cfg),
        lambda progress: reshard.run(opts, cfg, progress=progress), reshard.plot, plot_to,
    )  # fmt: skip


def _stepped(
    title: str,
    unit: str,
    steps: int,
    run: Callable[[Callable[[str], None]], Result],
    plot: Callable[[Result, Path], object],
    plot_to: Path | None,
) -> Result:
    """A bench that reports each measurement (a progress bar of `steps`), then its plot."""
    with Bar(steps, title, unit=unit) as bar:

        def step(what: str) -> None:
            bar.write(what)
            bar.advance(1)

        result = run(step)
    if plot_to is not None and result.details:
        plot(result, plot_to)
        print(f"plot written to {plot_to}", file=sys.stderr)
    return result


def _check_plot(path: Path | None) -> None:
    """Refuse `--plot` before a run that could not draw it (no matplotlib, no directory)."""
    if path is None:
        return
    if reason := matplotlib_missing():
        raise InvalidArgument(reason)
    if not path.parent.is_dir():
        raise InvalidArgument(f"--plot {path}: {path.parent} is not a directory")


def _transport(extra: list[str]) -> Result:
    """The transport benchmark with `extra` flags (its figures and targets are its own)."""
    from bench import transport

    return transport.run(
        transport.parser().parse_args(extra), " ".join(["tensorhub bench transport", *extra])
    )


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
    if name == "delta" and any(a == "--view" or a.startswith("--view=") for a in rest):
        from bench import view_delta  # deltas of a view, by the bytes (no links, no root)

        return view_delta.main(rest)
    if name == "views":  # what quantizing a view costs its publisher (bench.views)
        from bench import views

        return views.main(rest)
    if name == "watches":  # a hostile tenant's Watch streams on many names (bench.hostile)
        from bench import hostile

        return hostile.main(rest)
    opts_ns = _parse(name, rest)
    _check_plot(getattr(opts_ns, "plot", None))
    if os.geteuid() != 0:
        print(f"tensorhub bench {name}: {NeedsRoot.__doc__}", file=sys.stderr)
        return 2
    opts = options(opts_ns)
    cfg = delta.config(opts_ns) if name == "delta" else None
    if name == "reshard":
        emit([_reshard(opts, opts_ns.plot, reshard.config(opts_ns))], opts_ns.json)
        return 0
    if name != "all":
        emit([_one(name, opts, getattr(opts_ns, "plot", None), cfg)], opts_ns.json)
        return 0
    results: list[Result] = []
    with Bar(len(EMULATED) + 2, "bench all", unit="benchmark") as bar:
        for bench_name, fn in EMULATED.items():
            each = opts if bench_name != "crossdc" else Options(opts.rate_mbit, CROSSDC_MB,
                                                                opts.chunk_kb)  # fmt: skip
            bar.write(f"== {bench_name} ...")
            results.append(fn(each))
            bar.advance(1)
        bar.write("== transport ...")
        results.append(_transport(ALL_TRANSPORT))
        bar.advance(1)
        from bench.scale import cli as scale_cli

        results.extend(scale_cli.results(scale_cli.parse(ALL_SCALE)))
        bar.advance(1)
    emit(results, opts_ns.json)
    return 0 if all(r.ok for r in results) else 1
