"""`tensorhub bench delta --view FORMAT`: what a delta of a view saves, against a bf16 delta
and against the view sent whole (docs/views.md, "Deltas of views").

The model and its training are `bench delta`'s (`bench.emu.training`: a Llama of 36.3 M
parameters, 69.3 MiB in bf16, AdamW on fp32 master weights; `--tiny` for tests of the
harness). For each learning rate (1e-6, 1e-5, 1e-4), from the same initial weights and
data, `--steps` steps; after each, in this process:

- the bf16 weights, and their view (`ros.views.make_view`);
- the bytes a reader holding the step before needs: each chunk (`--chunk-kb`, 256 KiB, the
  version's layout as a publish lays it out, `transport.layout.Layout`) encoded against the
  same chunk of the step before by the codec a `delta=True` publish runs
  (`transport.delta.encode`: a chunk over 0.8 of its size goes whole), for the bf16
  version and for the view, and the view's bytes whole;
- the fraction of the view's scales (one per 128x128 block for `fp8-block128`, one per 32
  elements of a row for `mxfp8`) that changed, and of its e4m3 weight bytes.

No link and no hub: these are the encoded bytes a delta of each kind puts on the wire
(`bench delta` measures what the wire carries and how long it takes, for bf16 versions).
Figures per learning rate (medians over the steps): view delta / view whole, view delta /
bf16 delta, the share of scales changed. No targets: the outcome is the finding.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from bench.emu import training
from bench.report import Result, emit
from ros.views import FORMATS, make_view
from ros.views.view import view_format
from transport import delta as codec
from transport.layout import Layout
from transport.store import HeldVersion

LRS = (1e-6, 1e-5, 1e-4)
STEPS = 5


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="tensorhub bench delta --view", description="deltas of a view, by the bytes"
    )
    ap.add_argument("--view", required=True, choices=tuple(FORMATS), help="the view format")
    ap.add_argument("--steps", type=int, default=STEPS, help="training steps per learning rate")
    ap.add_argument("--chunk-kb", type=int, default=256, help="chunk size (KiB)")
    ap.add_argument(
        "--lrs", default=",".join(f"{lr:g}" for lr in LRS), metavar="LR[,LR...]",
        help="learning rates (default 1e-6,1e-5,1e-4)",
    )  # fmt: skip
    ap.add_argument("--tiny", action="store_true", help="a 1.1 MiB model (harness tests)")
    ap.add_argument("--json", metavar="PATH", help="write the figures as JSON (- = stdout)")
    return ap


def nbytes(tensors: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def delta_bytes(
    base: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor], chunk: int
) -> int:
    """The bytes of `new` encoded chunk by chunk against `base` (same names and shapes), as
    a delta publish encodes it: each chunk's encoding, or the chunk whole when the codec
    sends it whole."""
    layout = Layout.from_tensors(new, chunk)
    old = HeldVersion.publisher("bench", "m", 1, dict(base), layout)
    now = HeldVersion.publisher("bench", "m", 2, dict(new), layout)
    total = 0
    for index in range(layout.num_chunks):
        parts = now.chunk_parts(index)
        encoded = codec.encode(old.chunk_parts(index), parts)
        total += len(encoded) if encoded is not None else sum(p.numel() for p in parts)
    return total


def changed_share(
    base: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor], suffix: str
) -> tuple[float, float]:
    """(share of the scale elements that changed, share of the e4m3 weight bytes that
    changed) between two views; `suffix` is the scale tensors' name ending."""
    scales = changed = weights = moved = 0
    for name, tensor in new.items():
        if name.endswith(suffix):
            scales += tensor.numel()
            changed += _differ(tensor, base[name])
        elif tensor.dtype == torch.float8_e4m3fn:
            weights += tensor.numel()
            moved += _differ(tensor, base[name])
    return changed / max(scales, 1), moved / max(weights, 1)


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _differ(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many elements of `a` and `b` differ in their bits."""
    bits = _BITS[a.element_size()]
    return int((a.view(bits) != b.view(bits)).sum())


def one_lr(spec: training.Spec, lr: float, fmt: str, steps: int, chunk: int) -> dict[str, Any]:
    """`steps` steps at `lr`: each step's figures (module docstring)."""
    suffix = "." + view_format(fmt).scale_suffix
    trainer = training.Training(spec, lr)
    weights = trainer.weights()
    view, _ = make_view(weights, fmt)
    out: list[dict[str, Any]] = []
    for step in range(1, steps + 1):
        loss = trainer.step()
        new_weights = trainer.weights()
        new_view, _ = make_view(new_weights, fmt)
        scales, elements = changed_share(view, new_view, suffix)
        out.append({
            "step": step,
            "loss": round(loss, 4),
            "bf16_delta_bytes": delta_bytes(weights, new_weights, chunk),
            "view_delta_bytes": delta_bytes(view, new_view, chunk),
            "view_bytes": nbytes(new_view),
            "scales_changed": scales,
            "e4m3_bytes_changed": elements,
        })  # fmt: skip
        weights, view = new_weights, new_view
    return {"steps": out, "model_bytes": nbytes(weights)}


def run(args: argparse.Namespace) -> Result:
    lrs = tuple(float(x) for x in str(args.lrs).split(","))
    spec = training.TINY if args.tiny else training.DEFAULT
    flags = f" --view {args.view}" + (f" --steps {args.steps}" if args.steps != STEPS else "")
    flags += " --tiny" if args.tiny else ""
    res = Result("delta-view", "tensorhub bench delta" + flags)
    if why := training.missing():
        res.note = f"not run: {why}"
        return res
    if args.steps < 1 or args.chunk_kb < 4:
        raise SystemExit("--steps at least 1, --chunk-kb at least 4")
    started = time.monotonic()
    runs: dict[str, Any] = {}
    for lr in lrs:
        got = one_lr(spec, lr, args.view, args.steps, args.chunk_kb << 10)
        runs[f"lr {lr:g}"] = got
        steps = got["steps"]
        median = statistics.median
        whole = median(s["view_delta_bytes"] / s["view_bytes"] for s in steps)
        against = median(s["view_delta_bytes"] / max(s["bf16_delta_bytes"], 1) for s in steps)
        bf16 = median(s["bf16_delta_bytes"] / got["model_bytes"] for s in steps)
        name = f"lr {lr:g}"
        res.add(f"{name}: view delta / view whole", whole)
        res.add(f"{name}: view delta / bf16 delta", against)
        res.add(f"{name}: bf16 delta / bf16 model", bf16)
        res.add(f"{name}: scales changed per step",
                100 * median(s["scales_changed"] for s in steps), unit="%")  # fmt: skip
        res.add(f"{name}: e4m3 bytes changed per step",
                100 * median(s["e4m3_bytes_changed"] for s in steps), unit="%")  # fmt: skip
    res.details = {
        "view": args.view,
        "model": {**spec.to_dict(), "params": spec.params, "bf16_bytes": spec.nbytes},
        "chunk_bytes": args.chunk_kb << 10,
        "runs": runs,
        "loadavg_1m_after": os.getloadavg()[0],
    }
    res.seconds = time.monotonic() - started
    return res


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return emit([run(args)], args.json)


if __name__ == "__main__":
    sys.exit(main())
