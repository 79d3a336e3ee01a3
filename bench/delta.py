"""`tensorhub bench delta`: a trainer trains a real transformer and publishes every step as a
delta; 4 readers on 200 Mbit/s links fetch each step into the memory of the one before.

The model (`bench.emu.training`): a Llama of 36.3 M parameters (69.3 MiB in bf16), every
parameter trainable and every embedding row touched at every step, AdamW (weight decay
0.01) on fp32 master weights, each version the bf16 copy. For each learning rate (1e-6,
1e-5, 1e-4), from the same initial weights and data, in one run on the same emulated hosts
as `bench fanout` (one trainer, `--readers` readers, every host link shaped):

- version 1 is the initial weights, published with `delta=True` (whole: nothing to encode
  against yet) and fetched whole by every reader;
- each of `--steps` steps trains one batch, then publishes its bf16 weights with
  `delta=True`; the readers fetch it at once, each `into` the tensors of its previous
  fetch (released first). Update time: from the publish call in the trainer's process
  (encoding included) to the last reader's fetch returned (verified). Wire bytes: what the
  readers' host links delivered to them meanwhile (interface counters, frames included,
  hub traffic too), per reader;
- at the first, the middle and the last step, after that step's delta, the same weights
  are published again without a delta (model `{model}-full`) and every reader fetches them
  whole into memory of its own, written before the clock starts as a reader's own weights
  are (new pages would add their faults to the fetch): the update time of a full fetch,
  same run, same readers, same bytes;
- every reader's bytes are hashed at every fetch against the trainer's (`digest`).

Figures per learning rate: wire bytes per step / model bytes (the mean over the steps);
update time with deltas / with a full fetch (medians); (encode + apply) / one plain-socket
transfer of the model on one link, where encode is the publish's time with `delta=True` less
its time without (the medians over the steps and the full references: the encoding, the
companion's publish and the base copy) and apply is the readers' time in the codec's `apply`
and `chunk_checksum` (decode, XOR in place, the base check before and the result's check
after; summed over a reader's apply threads), the slowest reader's at each step, median over
the steps (`Held.delta.seconds`, which also holds the plan and the companion's read, is in
the details); and the fetches whose bytes differed from the trainer's (must be none); and
the delta path / a whole fetch: `Held.delta.seconds` (plan, the companion's read, apply,
verify; the slowest reader's, median over the steps) over the time of a whole fetch of the
same weights (the full reference's slowest reader, median). That last one compares two
fetches on the same links, so it is reported even where a plain socket does not saturate
them: with `--rate-mbit 40000` the links are as good as unshaped, and it is the cost of the
delta path against the CPU's own copy of the model.
Targets: lr 1e-6: wire bytes <= 0.04 x model, update time <= 0.1 x full; lr 1e-4: update
time <= 1.1 x full; bytes identical at every step, every reader, every learning rate; the
delta path <= 0.5 x a whole fetch at every learning rate.

`--plot FILE.png` (`plot`) draws the wire bytes per step against the step, one line per
learning rate. `--tiny` trains a 0.9 MiB model of the same kind (tests of the harness).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import MiB, Options
from bench.emu import training
from bench.emu.cluster import Cluster, settle
from bench.emu.control import Participant, Reply, broadcast
from bench.plots import line_chart
from bench.report import Result
from tensorhub.errors import InvalidArgument

LRS = (1e-6, 1e-5, 1e-4)
STEPS = 20
READERS = 4
PATH_TARGET = "<= 0.5"  # the delta path / a whole fetch (unshaped links: the CPU's cost)
TARGETS: dict[float, dict[str, str]] = {
    1e-6: {"bytes": "<= 0.04", "time": "<= 0.1"},
    1e-4: {"time": "<= 1.1"},
}
FETCH_TIMEOUT = 300.0


@dataclass(frozen=True)
class Config:
    """What `bench delta` trains and how many read it (`Options` has the links)."""

    steps: int = STEPS
    readers: int = READERS
    lrs: tuple[float, ...] = LRS
    spec: training.Spec = field(default_factory=lambda: training.DEFAULT)

    @property
    def full_at(self) -> tuple[int, ...]:
        """The steps also published and fetched whole (the reference): the first, the middle
        and the last, so that its median is of three fetches (one fetch of the whole
        model varies by half from one step to the next here)."""
        return tuple(sorted({1, (self.steps + 1) // 2, self.steps}))

    def flags(self) -> str:
        out = []
        if self.steps != STEPS:
            out.append(f"--steps {self.steps}")
        if self.readers != READERS:
            out.append(f"--readers {self.readers}")
        if self.lrs != LRS:
            out.append("--lrs " + ",".join(f"{lr:g}" for lr in self.lrs))
        if self.spec == training.TINY:
            out.append("--tiny")
        return (" " + " ".join(out)) if out else ""


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """`bench delta`'s flags: the links and chunks (as the other emulated benches; the
    model is the trained one, so no `--size-mb`), and what is trained and read."""
    ap.add_argument("--rate-mbit", type=float, default=200.0, help="each host link (Mbit/s)")
    ap.add_argument("--chunk-kb", type=int, default=256, help="chunk size (KiB)")
    ap.set_defaults(size_mb=Options().size_mb)  # unused: `bench.common.options` reads it
    ap.add_argument("--steps", type=int, default=STEPS, help="training steps per learning rate")
    ap.add_argument("--readers", type=int, default=READERS, help="reader hosts")
    ap.add_argument(
        "--lrs", type=_lrs, default=LRS, metavar="LR[,LR...]",
        help="learning rates (default 1e-6,1e-5,1e-4; targets exist for 1e-6 and 1e-4)",
    )  # fmt: skip
    ap.add_argument(
        "--tiny", action="store_true",
        help="a 0.9 MiB model of the same kind instead of the 69 MiB one (harness tests)",
    )  # fmt: skip
    ap.add_argument(
        "--view", metavar="FORMAT",
        help="count the bytes of deltas of this view (fp8-block128, mxfp8) against bf16 deltas "
        "instead, in process, no links (bench.view_delta: its own flags)",
    )  # fmt: skip


def _lrs(text: str) -> tuple[float, ...]:
    try:
        out = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: learning rates, comma-separated") from None
    if not out or any(not 0 < lr < 1 for lr in out):
        raise argparse.ArgumentTypeError(f"{text!r}: each learning rate in (0, 1)")
    return out


def config(args: argparse.Namespace) -> Config:
    """The `Config` the parsed flags of `add_arguments` ask for."""
    if args.steps < 1 or args.readers < 1:
        raise InvalidArgument("--steps and --readers: at least 1")
    spec = training.TINY if args.tiny else training.DEFAULT
    return Config(args.steps, args.readers, tuple(args.lrs), spec)


def model_name(lr: float) -> str:
    return f"lr{lr:g}".replace("+", "")


def label(lr: float) -> str:
    return f"lr {lr:g}"


def steps(cfg: Config) -> int:
    """How many measurements a run makes (for a progress bar)."""
    return len(cfg.lrs) * (1 + cfg.steps + len(cfg.full_at))


def run(
    opts: Options,
    cfg: Config | None = None,
    progress: Callable[[str], None] | None = None,
) -> Result:
    """The run (see the module docstring); `progress(what)` after each measurement."""
    cfg = cfg or Config()
    done = progress or (lambda what: None)
    res = Result("delta", "tensorhub bench delta" + _link_flags(opts) + cfg.flags())
    if why := training.missing():
        res.note = f"not run: {why}"
        return res
    started = time.monotonic()
    load = [os.getloadavg()[0]]  # the CPUs are shared: what else ran says how to read times
    nbytes = cfg.spec.nbytes
    with Cluster({1: 1 + cfg.readers}, opts.rate_mbit) as c:
        trainer, pool = c.parts[0], c.parts[1:]
        sat_bytes = max(nbytes, 16 * MiB)  # a tiny model is too short to measure a link by
        sat = c.saturation(c.parts, sat_bytes)
        one = sat.one_transfer * nbytes / sat_bytes
        runs = {}
        for lr in cfg.lrs:
            runs[lr] = _train_and_read(c, trainer, pool, opts, cfg, lr, done)
            load.append(os.getloadavg()[0])
    full_all: list[float] = []
    for lr, got in runs.items():
        summary = _summary(got, cfg.readers, nbytes, one)
        got["summary"] = summary
        want = TARGETS.get(lr, {})
        name = label(lr)
        res.add(f"{name}: wire bytes per step / model", summary["wire_per_model"],
                want.get("bytes", ""))  # fmt: skip
        res.add(f"{name}: update time, delta / full fetch", summary["time_ratio"],
                want.get("time", ""))  # fmt: skip
        res.add(f"{name}: (encode + apply) / one transfer", summary["encode_apply_ratio"])
        res.add(f"{name}: fetches with other bytes than the trainer's", summary["mismatched"],
                "<= 0", f"of {summary['fetches']}")  # fmt: skip
        full_all.extend(f["update_s"] for f in got["full"])
    res.add("full fetch update time (median)", statistics.median(full_all), unit="s")
    res.add("one transfer (plain socket)", one, unit="s")
    res.details = {
        "saturation": sat.to_dict(),
        "model": {**cfg.spec.to_dict(), "params": cfg.spec.params, "bf16_bytes": nbytes},
        "readers": cfg.readers,
        "steps": cfg.steps,
        "full_at": list(cfg.full_at),
        "rate_mbit": opts.rate_mbit,
        "chunk_bytes": opts.chunk,
        "one_transfer_s": one,
        "loadavg_1min": [round(x, 2) for x in load],  # at the start and after each lr
        "wire": {label(lr): _wire(got) for lr, got in runs.items()},
        "runs": {label(lr): got for lr, got in runs.items()},
    }
    if not sat.saturated:
        res.withhold(f"a plain socket reached only {sat.fraction:.0%} of the link rate")
    for lr, got in runs.items():  # two fetches on the same links: no link rate in it
        res.add(f"{label(lr)}: delta path / whole fetch", got["summary"]["path_ratio"],
                PATH_TARGET)  # fmt: skip
    res.seconds = time.monotonic() - started
    return res


def _wire(got: Mapping[str, Any]) -> dict[int, int]:
    """Wire bytes into the readers (all of them) by step."""
    return {s["step"]: s["wire_bytes"] for s in got["steps"]}


def _link_flags(opts: Options) -> str:
    """`opts.flags()` less the model size (this bench's model is `Config.spec`)."""
    return Options(opts.rate_mbit, Options().size_mb, opts.chunk_kb).flags()


def _train_and_read(
    c: Cluster,
    trainer: Participant,
    pool: list[Participant],
    opts: Options,
    cfg: Config,
    lr: float,
    done: Callable[[str], None],
) -> dict[str, Any]:
    """One learning rate: version 1 whole, then `cfg.steps` deltas, the full references."""
    model = model_name(lr)
    readers = [p.host.name for p in pool]
    spec = cfg.spec.to_dict()
    before = c.link_bytes()
    pub = trainer.call("train_init", 600, model=model, spec=spec, lr=lr, chunk=opts.chunk)
    got = broadcast(pool, "fetch_into", FETCH_TIMEOUT, model=model, version=1)
    init = _phase(0, pub, got, c, before, readers, trainer.host.name)
    done(f"{label(lr)}: version 1 whole in {init['update_s']:.2f}s")
    settle()
    out: dict[str, Any] = {"init": init, "steps": [], "full": []}
    for step in range(1, cfg.steps + 1):
        version = step + 1
        before = c.link_bytes()
        pub = trainer.call("train_step", 600, model=model, version=version, chunk=opts.chunk)
        got = broadcast(pool, "fetch_into", FETCH_TIMEOUT, model=model, version=version)
        one = _phase(step, pub, got, c, before, readers, trainer.host.name)
        out["steps"].append(one)
        done(
            f"{label(lr)} step {step}: {one['wire_bytes'] / len(pool) / MiB:.2f} MiB per "
            f"reader, {one['update_s']:.2f}s"
        )
        settle()
        if step in cfg.full_at:
            before = c.link_bytes()
            full = f"{model}-full"
            pub = trainer.call("publish_plain", 120, model=full, version=version,
                               chunk=opts.chunk)  # fmt: skip
            got = broadcast(pool, "fetch_into", FETCH_TIMEOUT, model=full, version=version,
                            delta=False, like=model)  # fmt: skip
            whole = _phase(step, pub, got, c, before, readers, trainer.host.name)
            out["full"].append(whole)
            done(f"{label(lr)} step {step} whole: {whole['update_s']:.2f}s")
            settle()
    broadcast([trainer, *pool], "drop", 60)
    settle()
    return out


def _phase(
    step: int,
    pub: Reply,
    got: Sequence[Reply],
    c: Cluster,
    before: Mapping[str, tuple[int, int]],
    readers: Sequence[str],
    trainer: str,
) -> dict[str, Any]:
    """What one publish and its readers' fetches measured."""
    after = c.link_bytes()
    deltas = [r["delta"] for r in got if r.get("delta")]
    return {
        "step": step,
        "update_s": max(r["t1"] for r in got) - pub["t0"],
        "publish_s": pub["t1"] - pub["t0"],
        "train_s": pub.get("train_s"),
        "loss": pub.get("loss"),
        "companion": pub["companion"],
        "encode_s": pub["encode_s"],  # in the codec's encode (trainer)
        "wire_bytes": sum(after[h][0] - before[h][0] for h in readers),
        "trainer_up_bytes": after[trainer][1] - before[trainer][1],
        "apply_s": max(r["apply_s"] + r["checksum_s"] for r in got),  # slowest reader
        "delta_s": max((d["seconds"] for d in deltas), default=0.0),  # Held.delta.seconds
        "fetch_s": [round(r["t1"] - r["t0"], 3) for r in got],
        "encoded_bytes": sum(d["encoded_bytes"] for d in deltas),
        "delta_chunks": sum(d["chunks"] for d in deltas),
        "whole_chunks": sum(d["whole_chunks"] for d in deltas),
        "base_mismatch": sum(d["base_mismatch"] for d in deltas),
        "fallbacks": sorted({d["fallback"] for d in deltas if d["fallback"]}),
        "used_delta": len(deltas),
        "mismatched": sum(r["digest"] != pub["digest"] for r in got),
        "digest": pub["digest"],
    }


def _summary(got: Mapping[str, Any], readers: int, nbytes: int, one: float) -> dict[str, Any]:
    """One learning rate's figures (module docstring)."""
    steps, full = got["steps"], got["full"]
    median = statistics.median
    plain_publish = median(f["publish_s"] for f in full)
    encode = median(s["publish_s"] for s in steps) - plain_publish
    apply = median(s["apply_s"] for s in steps)
    phases = [got["init"], *steps, *full]
    return {
        "wire_per_model": statistics.fmean(s["wire_bytes"] for s in steps) / readers / nbytes,
        "time_ratio": median(s["update_s"] for s in steps) / median(f["update_s"] for f in full),
        "path_ratio": median(s["delta_s"] for s in steps) / median(max(f["fetch_s"]) for f in full),
        "delta_path_s": median(s["delta_s"] for s in steps),
        "whole_fetch_s": median(max(f["fetch_s"]) for f in full),
        "encode_apply_ratio": (encode + apply) / one,
        "encode_s": encode,
        "codec_encode_s": median(s["encode_s"] for s in steps),
        "apply_s": apply,
        "delta_update_s": median(s["update_s"] for s in steps),
        "full_update_s": median(f["update_s"] for f in full),
        "mismatched": sum(p["mismatched"] for p in phases),
        "fetches": readers * len(phases),
        "steps_without_delta": sum(1 for s in steps if s["used_delta"] < readers),
    }


def series(details: Mapping[str, Any]) -> dict[str, dict[int, int]]:
    """Wire bytes (all readers) by step for each learning rate (keys may be strings after a
    JSON round trip)."""
    return {
        name: {int(s): int(b) for s, b in sorted(points.items(), key=lambda kv: int(kv[0]))}
        for name, points in details.get("wire", {}).items()
    }


def plot(result: Result, path: Path) -> dict[str, dict[int, int]]:
    """Wire bytes per step against the step, one line per learning rate, with the model's
    size times the readers as a reference line, as a PNG at `path` (matplotlib, log scale);
    the series are also stored in the PNG's text (key `tensorhub-series`) and returned."""
    lines = series(result.details)
    readers = int(result.details.get("readers", 1))
    nbytes = int(result.details.get("model", {}).get("bf16_bytes", 0))
    line_chart(
        path,
        lines,
        xlabel="training step",
        ylabel="MiB per reader on the wire",
        title=f"tensorhub bench delta: {nbytes / MiB:.1f} MiB bf16 model, {readers} readers",
        log_y=True,
        reference=(nbytes / MiB, "whole model") if nbytes else None,
        y_unit=readers * MiB,
    )
    return lines
