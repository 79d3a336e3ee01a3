"""`tensorhub bench reshard`: rollouts in vLLM's layout read their blocks of each version
from a trainer in another one, R in {1, 2, 4, 8} instances at once, every link shaped.

The model is the tiny Llama whose TP-2 layout vLLM's own loaders gave
(`bench.reshard_layout`, its fixture: merged `qkv_proj` and `gate_up_proj`, the one KV head
replicated), with as many decoder layers as make it about `--size-mb` (float32). The
trainer is Megatron-style TP 4, one rank per emulated host, each publishing its shard
(`--trainer-hosts 1`: one host publishes the whole model). Each rollout instance is TP 2,
one worker per emulated host (2R worker hosts); worker k takes TP rank k's blocks.

Per step (a new version): the trainer's ranks publish at once; then every worker of the R
instances reads its blocks at once with `fetch_slices`, through one of two paths, each in
the same run on the same hosts:
- `layout`: `fetch_slices(layout="vllm-tp2")`: a reader that becomes a holder of its blocks
  and reads first from the holders of the same blocks (`ros.client.layouts`);
- `slices`: `fetch_slices` without a layout: readers that hold nothing and read every byte
  from the trainer's shards.
Then, at the highest R only, the `layout` path with the instances one after another
(each starts when the one before it is done: readers that find a holder of their blocks),
for its bytes. T is from the first rank's publish call to the last worker's fetch
returned (every byte checked against the publisher's checksums, then against the digest
the orchestrator computes of that worker's blocks of the version); each R is the median
of `--steps` steps. Bytes are the host links' counters (frames included) over the step: out of the
trainer's hosts per model, into each worker's host per its blocks' bytes; each worker's
`bytes_per_source` counts what the SDK read, and from which holder. Per worker, the step
also records when its fetch ended (from the first publish call) and its start delay: from
its fetch call to its first request for chunks (the hub calls before it); the run reports
the start delays of the chained readers (those that read no byte from the trainer) at
the highest R.

`--plot FILE.png` (`plot`) draws T against R for both paths.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import MODEL, Options, add_options, verify
from bench.emu.cluster import Cluster, settle
from bench.emu.control import Participant, broadcast, gather
from bench.emu.reshard_ops import block_digest, tensors
from bench.plots import line_chart
from bench.report import Result
from bench.reshard_layout import BenchModel, bench_model, layers_for, load
from ros.client.publishing import DECLARED_TTL
from tensorhub.errors import InvalidArgument
from transport.pace import DEFAULT_RATE_FLOOR

READERS = (1, 2, 4, 8)
STEPS = 5
TP = 2
SIZE_MB = 16
RATE_MBIT = 100.0
# The trainer's chunk. Without a declaration (`--no-declare`) a worker reads whole trainer
# chunks, and every trainer rank holds the one KV head's k and v (128 KiB each here), which
# a worker takes from one rank only: a chunk of another rank that holds its rows beside
# those copies is read whole. At 256 KiB (the other benches' chunk, twice such a tensor)
# the first worker of a block set read 1.17x its blocks, at 64 KiB 1.05x (`--readers 1,8
# --steps 3`); declared, it reads only its blocks' byte ranges (1.00x). The chunks' own
# costs (a request, a checksum) stay small at 64 KiB, about 5 ms of a 100 Mbit/s link each.
CHUNK_KB = 64
PATHS: dict[str, str | None] = {"layout": f"vllm-tp{TP}", "slices": None}
STAGGERED = "layout, one instance after another"  # measured at the highest R only
SERIES = {"layout (readers hold their blocks)": "layout", "slices (readers hold nothing)": "slices"}


@dataclass(frozen=True)
class Config:
    """What `bench reshard` adds to the emulated-host options."""

    trainer_hosts: int = 4
    readers: tuple[int, ...] = READERS
    steps: int = STEPS
    rate_floor: float = DEFAULT_RATE_FLOOR
    fair_queues: bool = False
    declare: bool = True


def add_arguments(ap: argparse.ArgumentParser) -> None:
    add_options(ap, SIZE_MB)
    ap.set_defaults(rate_mbit=RATE_MBIT, chunk_kb=CHUNK_KB)
    ap.add_argument("--trainer-hosts", type=int, choices=(1, 4), default=4,
                    help="4: a TP-4 trainer, one rank per host; 1: one host publishes the "
                    "whole model")  # fmt: skip
    ap.add_argument("--readers", default=",".join(map(str, READERS)),
                    help="rollout instances (TP 2 each), comma separated")  # fmt: skip
    ap.add_argument("--steps", type=int, default=STEPS, help="steps per R (median)")
    ap.add_argument("--rate-floor", type=float, default=DEFAULT_RATE_FLOOR,
                    help="the workers' fetch_slices rate floor (bytes/s per connection; "
                    "0: off): a one-host trainer's link shared by 8 or 16 readers can give a "
                    "reader less")  # fmt: skip
    ap.add_argument("--fair-queues", action="store_true",
                    help="each host's upload queue fair across the hosts it sends to (as "
                    "a Linux host's fq_codel), not one FIFO: bench.emu.netns")  # fmt: skip
    ap.add_argument("--declare", action=argparse.BooleanOptionalAction, default=True,
                    help="declare the workers' layout after an unmeasured first version, "
                    "before the measured ones, as a vLLM rollout declares at start: the first "
                    "reader of a block set then reads only its blocks' bytes of the trainer's "
                    "chunks (--no-declare: whole chunks)")  # fmt: skip


def config(args: argparse.Namespace) -> Config:
    try:
        readers = tuple(sorted({int(r) for r in str(args.readers).split(",")}))
    except ValueError as exc:
        raise InvalidArgument(f"--readers {args.readers!r}: {exc}") from exc
    if not readers or min(readers) < 1 or args.steps < 1 or args.rate_floor < 0:
        raise InvalidArgument("--readers and --steps take positive numbers, --rate-floor >= 0")
    return Config(
        args.trainer_hosts, readers, args.steps, args.rate_floor, args.fair_queues, args.declare
    )


def steps(cfg: Config) -> int:
    """How many measured steps a run makes (for a progress bar)."""
    return (len(PATHS) * len(cfg.readers) + 1) * cfg.steps


@dataclass
class Step:
    """One measured step: T, the trainer hosts' bytes out per model, and per worker its
    host's bytes in and the SDK's bytes read, each per its blocks' bytes."""

    seconds: float
    trainer_out: float
    worker_in: list[float]
    worker_read: list[float]
    from_trainer: list[float]
    by_source: list[dict[str, int]]  # per worker: bytes read from each holder (the SDK's)
    ends: list[float]  # per worker: its fetch's return, seconds from the first publish call
    start_delays: list[float | None]  # per worker: fetch call to first chunk request

    def to_dict(self) -> dict[str, Any]:
        return {
            "T_s": round(self.seconds, 4),
            "trainer_out_per_model": round(self.trainer_out, 4),
            "worker_in_per_blocks": [round(x, 4) for x in self.worker_in],
            "worker_read_per_blocks": [round(x, 4) for x in self.worker_read],
            "worker_from_trainer_per_blocks": [round(x, 4) for x in self.from_trainer],
            "worker_bytes_by_source": self.by_source,
            "worker_end_s": [round(x, 4) for x in self.ends],
            "worker_start_delay_s": [None if x is None else round(x, 4) for x in self.start_delays],
        }

    def chained_delays(self) -> list[float]:
        """The start delays of the workers that read no byte from the trainer's shards."""
        return [
            d for d, t in zip(self.start_delays, self.from_trainer, strict=True)
            if d is not None and t == 0
        ]  # fmt: skip


def run(
    opts: Options, cfg: Config = Config(), progress: Callable[[str], None] | None = None
) -> Result:
    """The run (module docstring); `progress(what)` after each measured step."""
    flags = opts.flags() + ("" if cfg.trainer_hosts == 4 else " --trainer-hosts 1")
    if cfg.rate_floor != DEFAULT_RATE_FLOOR:
        flags += f" --rate-floor {cfg.rate_floor:g}"
    if cfg.fair_queues:
        flags += " --fair-queues"
    if not cfg.declare:
        flags += " --no-declare"
    res = Result("reshard", "tensorhub bench reshard" + flags)
    done = progress or (lambda what: None)
    recorded = load()
    bench = bench_model(recorded, TP, layers_for(recorded, opts.nbytes))
    hosts = cfg.trainer_hosts + TP * max(cfg.readers)
    started = time.monotonic()
    with Cluster({1: hosts}, opts.rate_mbit, fair=cfg.fair_queues) as c:
        trainer, pool = c.parts[: cfg.trainer_hosts], c.parts[cfg.trainer_hosts :]
        sat = c.saturation(c.parts, opts.nbytes)
        names = broadcast(c.parts, "reshard_setup", 60, tp=TP, layers=len(_layers(bench)))
        trainer_names = {n["holder"] for n in names[: cfg.trainer_hosts]}
        measured: dict[str, dict[int, list[Step]]] = {p: {} for p in PATHS}
        version = 0
        if cfg.declare:  # the hub takes a declaration of a model that has a version
            version += 1
            _declare(trainer, pool[0], version, opts)
        for r in cfg.readers:
            for path, layout in PATHS.items():
                for _ in range(cfg.steps):
                    version += 1
                    step = _step(c, trainer, pool[: TP * r], bench, opts, version, layout,
                                 trainer_names, cfg.rate_floor)  # fmt: skip
                    measured[path].setdefault(r, []).append(step)
                    done(f"{path} R={r} v{version}: T {step.seconds:.2f}s, trainer out "
                         f"{step.trainer_out:.2f} models")  # fmt: skip
                    settle()
        r = max(cfg.readers)
        for _ in range(cfg.steps):
            version += 1
            step = _step(c, trainer, pool[: TP * r], bench, opts, version, PATHS["layout"],
                         trainer_names, cfg.rate_floor, one_by_one=True)  # fmt: skip
            measured.setdefault(STAGGERED, {}).setdefault(r, []).append(step)
            done(f"{STAGGERED} R={r} v{version}: T {step.seconds:.2f}s, trainer out "
                 f"{step.trainer_out:.2f} models")  # fmt: skip
            settle()
    _figures(res, measured, cfg, bench, sat.one_transfer)
    res.details = {
        "saturation": sat.to_dict(),
        "model_bytes": bench.nbytes,
        "layers": len(_layers(bench)),
        "block_bytes": [bench.block_bytes(k) for k in range(TP)],
        "trainer_hosts": cfg.trainer_hosts,
        "rate_mbit": opts.rate_mbit,
        "fair_queues": cfg.fair_queues,
        "declared": cfg.declare,
        "T": {p: {r: _median_T(s) for r, s in by_r.items()} for p, by_r in measured.items()},
        "steps": {
            p: {r: [s.to_dict() for s in steps_] for r, steps_ in by_r.items()}
            for p, by_r in measured.items()
        },
    }
    if not sat.saturated:
        res.withhold(f"a plain socket reached only {sat.fraction:.0%} of the link rate")
    res.seconds = time.monotonic() - started
    return res


def _declare(trainer: list[Participant], worker: Participant, version: int, opts: Options) -> None:
    """Publish `version` (not measured), declare the workers' layout from `worker`, and
    release the version: every measured version carries the publisher's checksums of the
    workers' blocks. A shard's publisher uses the declarations it read up to
    `DECLARED_TTL` before (a whole publish reads them again when refused), so a sharded
    trainer's measured versions start once that has passed, as they would long after a
    rollout declared at its start."""
    for rank, p in enumerate(trainer):
        p.send("shard_publish", model=MODEL, version=version, seed=opts.seed, chunk=opts.chunk,
               rank=rank, ranks=len(trainer))  # fmt: skip
    gather(trainer, 120)
    broadcast([worker], "reshard_declare", 60, model=MODEL, layout=PATHS["layout"])
    broadcast(trainer, "reshard_release", 60, model=MODEL, version=version)
    if len(trainer) > 1:
        time.sleep(DECLARED_TTL + 0.5)


def _layers(bench: BenchModel) -> set[str]:
    return {n.split(".")[2] for n in bench.shapes if n.startswith("model.layers.")}


def _step(
    c: Cluster,
    trainer: list[Participant],
    workers: list[Participant],
    bench: BenchModel,
    opts: Options,
    version: int,
    layout: str | None,
    trainer_names: set[str],
    rate_floor: float,
    one_by_one: bool = False,
) -> Step:
    """Publish `version`, read every worker's blocks at once (`one_by_one`: instance after
    instance), check them, release."""
    whole = tensors(bench.shapes, opts.seed + version)
    expected = [block_digest(whole, bench.workers[k]) for k in range(TP)]
    del whole
    before = c.link_bytes()
    for rank, p in enumerate(trainer):
        p.send("shard_publish", model=MODEL, version=version, seed=opts.seed, chunk=opts.chunk,
               rank=rank, ranks=len(trainer))  # fmt: skip
    published = gather(trainer, 120)
    got: list[dict[str, Any]] = []
    instances = [workers[i : i + TP] for i in range(0, len(workers), TP)]
    for group in instances if one_by_one else [workers]:
        for i, w in enumerate(group):
            w.send("read_blocks", model=MODEL, version=version, rank=i % TP, layout=layout,
                   rate_floor=rate_floor)  # fmt: skip
        got.extend(gather(group, 300))
    after = c.link_bytes()
    for k in range(TP):
        verify(expected[k], got[k::TP], f"{layout or 'slices'} v{version} TP rank {k}")
    origin = min(p["t0"] for p in published)
    seconds = max(g["t1"] for g in got) - origin
    ends = [g["t1"] - origin for g in got]
    delays = [None if g["read_start"] is None else g["read_start"] - g["t0"] for g in got]
    out = sum(after[p.host.name][1] - before[p.host.name][1] for p in trainer)
    into, read, direct, sources = [], [], [], []
    for w, g in zip(workers, got, strict=True):
        blocks = g["block_bytes"]
        into.append((after[w.host.name][0] - before[w.host.name][0]) / blocks)
        per_source: Mapping[str, int] = g["bytes_per_source"]
        read.append(sum(per_source.values()) / blocks)
        direct.append(sum(n for s, n in per_source.items() if s in trainer_names) / blocks)
        sources.append(dict(per_source))
    broadcast([*workers, *trainer], "reshard_release", 60, model=MODEL, version=version)
    return Step(seconds, out / bench.nbytes, into, read, direct, sources, ends, delays)


def _median_T(steps_: list[Step]) -> float:  # noqa: N802
    return round(statistics.median(s.seconds for s in steps_), 4)


def _figures(
    res: Result,
    measured: Mapping[str, Mapping[int, list[Step]]],
    cfg: Config,
    bench: BenchModel,
    one_transfer: float,
) -> None:
    lo, hi = min(cfg.readers), max(cfg.readers)
    T = {p: {r: _median_T(s) for r, s in by_r.items()} for p, by_r in measured.items()}  # noqa: N806
    lay, old = measured["layout"], measured["slices"]

    def out(steps_: list[Step]) -> float:
        return statistics.median(s.trainer_out for s in steps_)

    res.add(f"layout T({hi})/T({lo})", T["layout"][hi] / T["layout"][lo], "<= 1.3")
    res.add("layout: trainer hosts' bytes out per step / model, highest R",
            max(out(s) for s in lay.values()), "<= 1.25")  # fmt: skip
    res.add("layout: bytes into a worker's host / its blocks, highest",
            max(x for s in lay.values() for st in s for x in st.worker_in), "<= 1.05")  # fmt: skip
    res.add("layout: bytes a worker read (SDK) / its blocks, highest",
            max(x for s in lay.values() for st in s for x in st.worker_read))  # fmt: skip
    res.add(f"slices T({hi})/T({lo})", T["slices"][hi] / T["slices"][lo])
    res.add(f"slices: trainer hosts' bytes out per step / model at R={hi}", out(old[hi]))
    res.add("slices: bytes into a worker's host / its blocks, highest",
            max(x for s in old.values() for st in s for x in st.worker_in))  # fmt: skip
    res.add(f"slices T({hi}) / layout T({hi})", T["slices"][hi] / T["layout"][hi])
    if STAGGERED in measured:
        one = measured[STAGGERED][hi]
        res.add(f"{STAGGERED}: trainer hosts' bytes out per step / model at R={hi}", out(one))
        res.add(f"{STAGGERED}: T({hi}) / layout T({lo})", T[STAGGERED][hi] / T["layout"][lo])
    res.add(f"layout T({lo}) / one transfer of the model", T["layout"][lo] / one_transfer)
    chained = sorted(d for st in lay[hi] for d in st.chained_delays())
    if chained:
        res.add(f"layout: chained readers' start delay at R={hi}, median",
                statistics.median(chained), unit="s")  # fmt: skip
        res.add(f"layout: chained readers' start delay at R={hi}, highest", chained[-1], unit="s")
    res.add("workers whose blocks differ from the trainer's", 0, "<= 0", "workers")
    res.add(f"layout T({hi})", T["layout"][hi], unit="s")
    res.add(f"slices T({hi})", T["slices"][hi], unit="s")
    res.add("model", bench.nbytes / (1 << 20), unit="MiB")


def series(details: Mapping[str, Any]) -> dict[str, dict[int, float]]:
    """Seconds by R for each path (keys may be strings after a JSON round trip)."""
    return {
        label: {int(r): float(t) for r, t in sorted(details["T"][key].items(),
                                                     key=lambda kv: int(kv[0]))}
        for label, key in SERIES.items()
        if details.get("T", {}).get(key)
    }  # fmt: skip


def plot(result: Result, path: Path) -> dict[str, dict[int, float]]:
    """T against R for both paths, as a PNG at `path` (matplotlib); the series drawn are
    stored in the PNG's text (key `tensorhub-series`) and returned."""
    lines = series(result.details)
    mib = result.details.get("model_bytes", 0) / (1 << 20)
    hosts = result.details.get("trainer_hosts", 4)
    line_chart(
        path,
        lines,
        xlabel="rollout instances (TP 2 each)",
        ylabel="seconds, publish to the last worker verified",
        title=f"tensorhub bench reshard: {mib:.0f} MiB, {hosts}-host trainer -> vLLM TP 2",
    )
    return lines
