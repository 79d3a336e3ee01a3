"""`tensorhub bench views`: what quantizing a view costs its publisher.

The model is the one `bench delta` trains (`bench.emu.training.DEFAULT`: a Llama of
36.3 M parameters, 69.3 MiB in bf16; `--tiny` for tests of the harness), its weights as a
publisher holds them (bf16). In one run:

- one transfer of the bf16 model over a `--rate-mbit` (200) link: a plain socket between
  two emulated hosts (`bench.emu.cluster.Cluster.saturation`, the median link of the
  ring), as root; without root, or with `--no-emulation`, computed as bytes x 8 / rate;
- for each view format, `ros.views.make_view` on the model, `--repeat` times: the median
  time, and the peak memory it adds (the largest of the runs, after one small warm-up
  quantization that pages in torch's code): on the CPU the process's peak resident set
  (`VmHWM`, reset through `/proc/self/clear_refs` before each run) above its resident set
  before, on a GPU `torch.cuda.max_memory_allocated` above the allocation before.

Figures per format, against the targets of docs/views.md: quantize time / one transfer (<= 0.5) and
peak added memory / model bytes (<= 0.5). `--threads N` sets torch's CPU threads (the
default is torch's own choice; the CPUs here are shared, so the load average is in the
details).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import gc
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from bench.common import MiB
from bench.emu import training
from bench.report import Result, emit
from ros.views import FORMATS, make_view

TARGET_TIME = "<= 0.5"  # x one transfer of the bf16 model
TARGET_MEMORY = "<= 0.5"  # x the bf16 model's bytes
_CLEAR_REFS = Path("/proc/self/clear_refs")
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
_STATUS = Path("/proc/self/status")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tensorhub bench views", description="the cost of a view")
    ap.add_argument("--rate-mbit", type=float, default=200.0, help="the link (Mbit/s)")
    ap.add_argument("--repeat", type=int, default=5, help="quantizations per format (median)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's)")
    ap.add_argument("--device", default="cpu", help="where the weights are (cpu, cuda)")
    ap.add_argument("--tiny", action="store_true", help="a 1.1 MiB model (harness tests)")
    ap.add_argument(
        "--no-emulation", action="store_true",
        help="compute the transfer as bytes x 8 / rate instead of measuring it",
    )  # fmt: skip
    ap.add_argument("--json", metavar="PATH", help="write the figures as JSON (- = stdout)")
    return ap


def model_weights(spec: training.Spec, device: str) -> dict[str, torch.Tensor]:
    """The bf16 weights of `spec`'s model on `device` (its fp32 master freed)."""
    trainer = training.Training(spec, lr=1e-6)
    weights = {k: v.to(device) for k, v in trainer.weights().items()}
    del trainer
    gc.collect()
    return weights


def _status_bytes(field: str) -> int:
    for line in _STATUS.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise OSError(f"{_STATUS} has no {field}")


def fixed_malloc_thresholds() -> bool:
    """Make glibc's malloc serve every block of 128 KiB or more by mmap, and give freed
    memory back, from now on: its default raises the mmap threshold to the size of each
    large block freed, after which freed tensors stay resident and a second measurement
    sees none of its own peak. False where this is not glibc."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    libc = ctypes.CDLL(name)
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, 128 * 1024) and mallopt(_M_TRIM_THRESHOLD, 128 * 1024))


class PeakMemory:
    """The peak memory a block of code adds where the tensors are: on the CPU, VmHWM (the
    peak resident set, reset by writing 5 to /proc/self/clear_refs) above VmRSS before; on
    CUDA, max_memory_allocated above memory_allocated before."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")
        self.base = 0
        self.added = 0

    def __enter__(self) -> PeakMemory:
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            _CLEAR_REFS.write_text("5")
            self.base = _status_bytes("VmRSS")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            self.added = torch.cuda.max_memory_allocated() - self.base
        else:
            self.added = _status_bytes("VmHWM") - self.base


def quantize(weights: dict[str, torch.Tensor], fmt: str, device: str) -> tuple[float, int, int]:
    """One `make_view`: (seconds, peak bytes added, bytes of the tensors it created)."""
    with PeakMemory(device) as mem:
        start = time.perf_counter()
        tensors, _ = make_view(weights, fmt)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    made = sum(t.numel() * t.element_size() for k, t in tensors.items() if weights.get(k) is not t)
    del tensors
    return seconds, mem.added, made


def one_transfer(nbytes: int, rate_mbit: float, emulate: bool) -> tuple[float, dict[str, Any]]:
    """Seconds for `nbytes` over one `rate_mbit` link: measured on emulated hosts when
    `emulate` (root), else computed."""
    computed = nbytes * 8 / (rate_mbit * 1e6)
    if not emulate:
        return computed, {"how": "computed: bytes x 8 / rate", "computed_s": round(computed, 3)}
    from bench.emu.cluster import Cluster

    sat_bytes = max(nbytes, 16 * MiB)  # a tiny model is too short to measure a link by
    with Cluster({1: 2}, rate_mbit, hub=False) as c:
        sat = c.saturation(c.parts, sat_bytes)
    seconds = sat.one_transfer * nbytes / sat_bytes
    how = {"how": "measured: plain socket between two emulated hosts", **sat.to_dict()}
    return seconds, {**how, "computed_s": round(computed, 3), "saturated": sat.saturated}


def run(args: argparse.Namespace) -> Result:
    if args.threads:
        torch.set_num_threads(args.threads)
    spec = training.TINY if args.tiny else training.DEFAULT
    flags = [f for f, on in (("--tiny", args.tiny), ("--no-emulation", args.no_emulation)) if on]
    if args.threads:
        flags.append(f"--threads {args.threads}")
    if args.device != "cpu":
        flags.append(f"--device {args.device}")
    res = Result("views", " ".join(["python -m bench.views", *flags]))
    if why := training.missing():
        res.note = f"not run: {why}"
        return res
    started = time.monotonic()
    fixed = fixed_malloc_thresholds()
    emulate = not args.no_emulation and os.geteuid() == 0
    nbytes = spec.nbytes
    transfer, link = one_transfer(nbytes, args.rate_mbit, emulate)
    weights = model_weights(spec, args.device)
    model_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    res.details = {
        "model": spec.to_dict(), "model_bytes": model_bytes, "link": link,
        "one_transfer_s": round(transfer, 3), "threads": torch.get_num_threads(),
        "device": args.device, "malloc_thresholds_fixed": fixed,
        "loadavg_1m": os.getloadavg()[0], "formats": {},
    }  # fmt: skip
    warm = {"model.layers.0.mlp.up_proj.weight": next(iter(weights.values()))[:256, :256]}
    for fmt in FORMATS:
        make_view(warm, fmt)  # torch's first call of each kernel pages in code: not a view's
        runs = [quantize(weights, fmt, args.device) for _ in range(max(1, args.repeat))]
        seconds = statistics.median(r[0] for r in runs)
        peak = max(r[1] for r in runs)
        res.details["formats"][fmt] = {
            "seconds": [round(r[0], 3) for r in runs],
            "peak_added_bytes": [r[1] for r in runs],
            "view_bytes_made": runs[0][2],
        }
        res.add(f"{fmt}: quantize / one transfer", seconds / transfer, TARGET_TIME)
        res.add(f"{fmt}: peak added memory / model", peak / model_bytes, TARGET_MEMORY)
        res.add(f"{fmt}: quantize time", seconds, unit="s")
        res.add(f"{fmt}: peak added memory", peak / MiB, unit="MiB")
    res.add("one transfer of the bf16 model", transfer, unit="s")
    res.details["loadavg_1m_after"] = os.getloadavg()[0]
    res.seconds = time.monotonic() - started
    if emulate and not link.get("saturated", True):
        res.withhold("the emulated link ran below 85% of its rate: the CPUs were the limit")
    return res


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return emit([run(args)], args.json)


if __name__ == "__main__":
    sys.exit(main())
