"""`tensorhub bench gpu`: the GPU memory paths against ceilings measured in the same run.

For a model of `--size-mb` MiB in device memory (default 2 GiB, the size of a small policy):

- **TCP staging.** A holder process serves the CUDA tensors over loopback TCP (pinned host
  staging); this process fetches them into CUDA tensors. Ceiling: the lesser of the pinned
  host↔device copy rate (one chunk-sized pinned buffer, both directions, the slower one) and
  the loopback TCP rate of the same data plane host to host, both measured here.
  Target: ≥ 0.8.
- **GPU checksums.** `wsum64` of every chunk on the device (`transport.checksums`) against a
  device-to-device `copy_` of the same bytes. Target: ≥ 0.3.
- **Publish.** The manifest built with GPU checksums (`wsum64`: kernels, 8 bytes back per
  chunk) against the same with host xxh3 (every chunk copied device→host first): the time
  a publish spends on checksums, both ways (a figure, with no target).
- **CUDA IPC.** The holder process also grants CUDA IPC leases (`transport.ipc`); this
  process fetches the version into its own GPU tensors over IPC, every chunk verified
  against the holder's wsum64 sums, against a device-to-device `copy_` of the same bytes in
  one process. Target: ≥ 0.5. On one GPU this is same-device IPC only. With `--device cpu`
  there is no IPC figure (IPC maps GPU memory).

`--device cpu` runs the same code on host tensors (a smoke run of the bench itself; its
ratios say nothing about a GPU). Without a CUDA device and without `--device cpu` it exits 2
with the reason.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection

import torch

from bench.open_verifier import allow_all
from bench.report import Result, table
from ros.client.manifest import manifest_of
from transport.backend import TransportKind
from transport.checksums import WSUM64, XXH3
from transport.ipc.server import IpcControlServer
from transport.layout import Layout
from transport.outcome import FetchStats
from transport.planner import Source
from transport.reader import fetch
from transport.server import HolderServer
from transport.store import HeldVersion, HolderStore
from transport.topology import Topology

MiB = 1 << 20
TCP_TARGET, CHECKSUM_TARGET, IPC_TARGET = 0.8, 0.3, 0.5


def _model(size_mb: int, device: str) -> dict[str, torch.Tensor]:
    """About `size_mb` MiB in eight float32 tensors on `device`, filled (not just allocated)."""
    elems = max(1, size_mb * MiB // 4 // 8)
    return {f"layer.{i}": torch.full((elems,), float(i) + 0.5, device=device) for i in range(8)}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _best(fn: Callable[[], object], device: str, repeat: int) -> float:
    """The fastest of `repeat` runs of `fn`, in seconds (interference only slows a run)."""
    times = []
    for _ in range(repeat):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return min(times)


def _holder(size_mb: int, chunk: int, device: str, pipe: Connection) -> None:
    """Child process: serve the model from `device` memory (over TCP, and over CUDA IPC on
    a GPU), and again from host memory over TCP."""
    stores = {}
    ipc: IpcControlServer | None = None
    sums: list[int] = []
    for where in (device, "cpu"):
        tensors = _model(size_mb, where)
        layout = Layout.from_tensors(tensors, chunk_size=chunk)
        store = HolderStore()
        held = HeldVersion.publisher("bench", "model", 1, tensors, layout)
        held.precompute_checksums()  # publish-time work, outside the measured fetch
        store.add(held)
        stores[where] = (HolderServer(store, allow_all).start(), layout)
        if where == "cuda":
            sums = [held.wsum64(i) for i in range(layout.num_chunks)]
            ipc = IpcControlServer(store, allow_all).start()
    served = {where: (srv.address, lay.to_dict()) for where, (srv, lay) in stores.items()}
    pipe.send({"served": served, "ipc": ipc.address if ipc else None, "sums": sums})
    pipe.recv()  # the parent says stop
    for server, _ in stores.values():
        server.stop()
    if ipc is not None:
        ipc.stop()


def _fetch_rate(
    source: Source, layout: Layout, device: str, repeat: int, sums: list[int] | None = None
) -> tuple[float, FetchStats]:
    """Bytes/s of a fetch of the served model from `source` into `device` tensors (best of
    `repeat`), verified against `sums` (wsum64) when given; and the last fetch's stats."""
    into = {k: t.zero_() for k, t in layout.allocate(device).items()}
    last: list[FetchStats] = []

    def once() -> None:
        dest = HeldVersion.reader("bench", "model", 1, layout, into)
        last[:] = [fetch(
            "bench", "model", 1, layout, dest, [source], token=b"",
            deadline=time.monotonic() + 300, me=Topology(), expected=sums,
            checksum=WSUM64 if sums else XXH3,
        )]  # fmt: skip

    return layout.total_bytes / _best(once, device, repeat), last[0]


def _pinned_rate(chunk: int, device: str, repeat: int) -> float:
    """The slower direction of pinned host↔device copies of one chunk-sized buffer, B/s."""
    if device != "cuda":
        host = torch.empty(chunk, dtype=torch.uint8)
        other = torch.empty(chunk, dtype=torch.uint8)
        return chunk / _best(lambda: other.copy_(host), device, repeat * 20)
    host = torch.empty(chunk, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(chunk, dtype=torch.uint8, device="cuda")
    h2d = _best(lambda: dev.copy_(host, non_blocking=True), device, repeat * 20)
    d2h = _best(lambda: host.copy_(dev, non_blocking=True), device, repeat * 20)
    return chunk / max(h2d, d2h)


def run(args: argparse.Namespace, command: str) -> Result:
    device, chunk = args.device, args.chunk_mb * MiB
    started = time.monotonic()
    res = Result("gpu", command)
    if device == "cpu":
        res.note = "--device cpu: a smoke run of the bench on host tensors; no GPU figure"
    # checksums and publish, in this process
    tensors = _model(args.size_mb, device)
    layout = Layout.from_tensors(tensors, chunk_size=chunk)
    held = HeldVersion.publisher("bench", "model", 1, tensors, layout)
    flat = torch.cat([t.view(torch.uint8) for t in tensors.values()])
    copy = torch.empty_like(flat)
    copy_s = _best(lambda: copy.copy_(flat), device, args.repeat)
    chunks = range(layout.num_chunks)
    sums_s = _best(lambda: [held.wsum64(i) for i in chunks], device, args.repeat)
    gpu_publish = _best(lambda: manifest_of(held, checksum=WSUM64), device, args.repeat)

    def host_publish() -> None:
        fresh = HeldVersion.publisher("bench", "model", 1, tensors, layout)  # no cached sums
        manifest_of(fresh, checksum=XXH3)

    xxh3_publish = _best(host_publish, device, args.repeat)
    size = layout.total_bytes
    res.add("GPU checksum rate / device copy rate", copy_s / sums_s, f">= {CHECKSUM_TARGET}")
    res.add("wsum64 on the device", size / sums_s / 1e9, unit="GB/s")
    res.add("device-to-device copy_ (bytes copied)", size / copy_s / 1e9, unit="GB/s")
    res.add("publish checksums: host xxh3 / GPU wsum64", xxh3_publish / gpu_publish)
    res.add("publish checksums with GPU wsum64", gpu_publish, unit="s")
    res.add("publish checksums with host xxh3", xxh3_publish, unit="s")
    # TCP staging, against a holder process
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    child = ctx.Process(target=_holder, args=(args.size_mb, chunk, device, theirs), daemon=True)
    child.start()
    try:
        info = ours.recv()
        served = info["served"]
        (dev_addr, dev_layout), (cpu_addr, cpu_layout) = served[device], served["cpu"]
        dev_layout = Layout.from_dict(dev_layout)
        staged, _ = _fetch_rate(Source("holder", *dev_addr), dev_layout, device, args.repeat)
        tcp_source = Source("holder", *cpu_addr)
        tcp, _ = _fetch_rate(tcp_source, Layout.from_dict(cpu_layout), "cpu", args.repeat)
        if info["ipc"] is not None:
            ipc_host, ipc_port = info["ipc"]
            dev_host, dev_port = dev_addr
            ipc_source = Source(
                "holder", ipc_host, ipc_port, transport=TransportKind.IPC,
                tcp=(dev_host, dev_port),
            )  # fmt: skip
            ipc, ipc_stats = _fetch_rate(ipc_source, dev_layout, device, args.repeat, info["sums"])
    finally:
        ours.send("stop")
        child.join(timeout=10)
    pinned = _pinned_rate(chunk, device, args.repeat)
    ceiling = min(pinned, tcp)
    res.add("TCP staging / min(pinned copy, loopback TCP)", staged / ceiling, f">= {TCP_TARGET}")
    res.add(f"{device} -> {device} over loopback TCP", staged / 1e9, unit="GB/s")
    res.add("pinned host<->device copy (slower direction)", pinned / 1e9, unit="GB/s")
    res.add("loopback TCP, host to host (same data plane)", tcp / 1e9, unit="GB/s")
    res.details = {
        "size_bytes": size, "chunk_bytes": chunk, "repeat": args.repeat, "device": device,
    }  # fmt: skip
    if info["ipc"] is None:
        res.details["cuda_ipc"] = "needs a GPU (--device cpu): no figure"
    else:
        over = ipc_stats.transports.get("holder", "?")
        res.details["cuda_ipc"] = {"transport": over, "fallbacks": ipc_stats.fallbacks}
        res.add(
            "CUDA IPC (verified) / device-to-device copy_",
            ipc / (size / copy_s),
            f">= {IPC_TARGET}",
        )
        res.add(f"CUDA IPC between two processes, over {over}", ipc / 1e9, unit="GB/s")
    res.seconds = time.monotonic() - started
    return res


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tensorhub bench gpu", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--size-mb", type=int, default=2048, help="model size (default 2 GiB)")
    ap.add_argument("--chunk-mb", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3, help="runs of each figure; the best counts")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cpu: a smoke run of the bench itself on host tensors")  # fmt: skip
    ap.add_argument("--json", metavar="PATH")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.size_mb < 1 or args.chunk_mb < 1 or args.repeat < 1:
        print("tensorhub bench gpu: --size-mb, --chunk-mb and --repeat must be >= 1")
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("tensorhub bench gpu: needs a CUDA device (torch.cuda.is_available() is False); "
              "--device cpu runs the bench itself on host tensors")  # fmt: skip
        return 2
    flags = list(sys.argv[1:] if argv is None else argv)
    res = run(args, " ".join(["tensorhub bench gpu", *flags]))
    print(f"{args.size_mb} MiB, {args.chunk_mb} MiB chunks, {args.device}; best of {args.repeat}")
    if res.note:
        print(f"note: {res.note}")
    print(table([res]))
    ipc = res.details.get("cuda_ipc")
    if isinstance(ipc, str):
        print(f"CUDA IPC: {ipc}")
    elif isinstance(ipc, dict) and ipc.get("fallbacks"):
        print(f"CUDA IPC fell back: {ipc['fallbacks']}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res.to_dict(), fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
