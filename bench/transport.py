"""`tensorhub bench transport`: TensorHub's TCP data plane against two loopback references.

One holder process serves a model of `--size-mb` MiB over loopback; this process fetches
it with `transport.reader.fetch`. The references, measured in the same run:

- a plain Python socket: the same holder process sends the same bytes with `sendall`
  (memoryview) into `recv_into` of a preallocated buffer here, so sender and receiver live
  where TensorHub's do and the two measurements are symmetric;
- iperf3 (`bench.iperf`): C on both ends, asked for with `-Z -l 4M` (zero copy, large
  writes); the better of `-Z` and plain writes, at the largest block the binary accepts
  (Debian 12's caps it at 1 MiB). Skipped, and said so, where iperf3 is not installed.

And one more figure that explains the gap to iperf3: the plain Python socket again, but
with iperf3's working set, one 1 MiB buffer sent and received over and over on each end
(cache-resident), where TensorHub and the plain socket stream a model-sized buffer from one
process's memory into another's. Its ratio to iperf3 says how much of the gap is Python
(none, if it is ~1) and its ratio to the plain socket how much is the working set.

Each is measured with one connection and with `--parallel` connections (the plain socket
then splits the bytes into that many ranges, one connection each; iperf3 runs `-P N`).
Prints the table of `bench.report` with TensorHub's ratio to both references; the target:
TensorHub >= 0.9x the better of the two, at each connection count.

NIXL rows (`bench.transport_nixl`), measured in the same rounds: NIXL over UCX's TCP
transport and over same-host cma, one channel each, every chunk verified, from one holder
process per mode; a memcpy of a model-sized buffer in this process (one thread), the
ceiling for cma. Figures without targets: NIXL-tcp / plain socket (1 conn) and NIXL-cma /
memcpy. Left out with `--no-nixl`, and where NIXL cannot be imported (a note says why).
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import socket
import statistics
import struct
import sys
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection

import torch

from bench.iperf import Iperf3
from bench.open_verifier import allow_all
from bench.report import Result, table
from bench.transport_nixl import Nixl
from transport.layout import Layout
from transport.reader import DEFAULT_PARALLEL, Source, fetch
from transport.server import HolderServer
from transport.store import HeldVersion, HolderStore
from transport.topology import Topology

TARGET = 0.9
MiB = 1024 * 1024
PLAIN_PIECE = 4 * MiB  # bounded recv sizes: an unbounded recv_into is slower on loopback
RANGE = struct.Struct("!QQ")  # what a plain-socket client asks for: (offset, length)


def _model(size_mb: int) -> dict[str, torch.Tensor]:
    """About `size_mb` MiB of float32 in eight tensors, plus 500 small ones."""
    small = {f"norm.{i}": torch.full((256,), float(i)) for i in range(500)}
    big_elems = max(1, (size_mb * MiB - 500 * 1024) // 4 // 8)
    big = {f"layer.{i}": torch.full((big_elems,), float(i) + 0.5) for i in range(8)}
    return {**big, **small}


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        got = conn.recv(n - len(data))
        if not got:
            raise ConnectionError("plain-socket client closed before asking for a range")
        data += got
    return data


def _holder(size_mb: int, chunk: int, pipe: Connection) -> None:
    """Child process: serve the model with HolderServer and with a plain socket."""
    tensors = _model(size_mb)
    layout = Layout.from_tensors(tensors, chunk_size=chunk)
    store = HolderStore()
    held = HeldVersion.publisher("bench", "model", 1, tensors, layout)
    held.precompute_checksums()  # publish-time work, outside the measured fetch
    store.add(held)
    server = HolderServer(store, allow_all).start()
    flat = torch.full((layout.total_bytes,), 7, dtype=torch.uint8)  # touched, like the model
    view = flat.numpy().data.cast("B")
    plain = socket.create_server(("127.0.0.1", 0), backlog=64)
    small = socket.create_server(("127.0.0.1", 0), backlog=64)  # iperf3's working set
    block = memoryview(bytearray(b"\x07" * MiB))
    pipe.send((server.address, plain.getsockname()[1], small.getsockname()[1], layout.to_dict()))

    def send_range(conn: socket.socket) -> None:
        with conn:
            offset, length = RANGE.unpack(_recv_exact(conn, RANGE.size))
            conn.sendall(view[offset : offset + length])

    def send_block(conn: socket.socket) -> None:
        with conn:
            _, length = RANGE.unpack(_recv_exact(conn, RANGE.size))
            while length > 0:
                n = min(length, MiB)
                conn.sendall(block[:n])
                length -= n

    def loop(listener: socket.socket, serve: Callable[[socket.socket], None]) -> None:
        while True:
            conn, _ = listener.accept()
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=loop, args=(plain, send_range), daemon=True).start()
    threading.Thread(target=loop, args=(small, send_block), daemon=True).start()
    pipe.recv()  # parent says stop
    server.stop()


def _plain_range(port: int, buf: memoryview, lo: int, hi: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(RANGE.pack(lo, hi - lo))
        pos = lo
        while pos < hi:
            got = sock.recv_into(buf[pos : min(pos + PLAIN_PIECE, hi)])
            if not got:
                raise ConnectionError("plain sender closed early")
            pos += got


def _block_range(port: int, length: int) -> None:
    """Receive `length` bytes into one reused 1 MiB buffer (iperf3's working set)."""
    block = memoryview(bytearray(MiB))
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(RANGE.pack(0, length))
        while length > 0:
            got = sock.recv_into(block[: min(MiB, length)])
            if not got:
                raise ConnectionError("plain sender closed early")
            length -= got


def _block_once(port: int, size: int) -> float:
    """Seconds to receive `size` bytes over one connection into a reused 1 MiB buffer."""
    start = time.perf_counter()
    _block_range(port, size)
    return time.perf_counter() - start


def _plain_once(port: int, buf: memoryview, streams: int) -> float:
    """Seconds to receive all of `buf` over `streams` plain connections, one range each."""
    cuts = [len(buf) * i // streams for i in range(streams + 1)]
    errors: list[BaseException] = []

    def one(lo: int, hi: int) -> None:
        try:
            _plain_range(port, buf, lo, hi)
        except OSError as exc:
            errors.append(exc)

    start = time.perf_counter()
    threads = [threading.Thread(target=one, args=pair) for pair in itertools.pairwise(cuts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    if errors:
        raise errors[0]
    return elapsed


def _tensorhub_once(
    addr: tuple[str, int], layout: Layout, into: dict[str, torch.Tensor], parallel: int
) -> float:
    dest = HeldVersion.reader("bench", "model", 1, layout, into)
    source = Source("holder", addr[0], addr[1], Topology())
    start = time.perf_counter()
    fetch(
        "bench",
        "model",
        1,
        layout,
        dest,
        [source],
        token=b"",
        deadline=time.monotonic() + 120,
        me=Topology(),
        parallel=parallel,
    )
    return time.perf_counter() - start


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tensorhub bench transport", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--size-mb", type=int, default=1024)
    ap.add_argument("--chunk-mb", type=int, default=4)
    ap.add_argument("--parallel", type=int, default=DEFAULT_PARALLEL,
                    help="connections of the second setting (the first is always 1; "
                         "default: the SDK's, %(default)s)")  # fmt: skip
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--iperf-seconds", type=int, default=2, help="length of one iperf3 run")
    ap.add_argument(
        "--no-nixl",
        dest="nixl",
        action="store_false",
        help="leave out the NIXL rows (NIXL over UCX tcp and cma, and the memcpy "
        "ceiling); left out anyway, with a note, where NIXL cannot be imported",
    )
    ap.add_argument("--json", metavar="PATH")
    return ap


def _gbps(size: int, seconds: Sequence[float]) -> float:
    return size / min(seconds) / 1e9  # best of N: interference only ever makes a run slower


def run(args: argparse.Namespace, command: str = "tensorhub bench transport") -> Result:
    """Measure every setting, interleaved so that drift affects each alike."""
    settings = sorted({1, max(1, args.parallel)})
    started = time.monotonic()
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    child = ctx.Process(
        target=_holder, args=(args.size_mb, args.chunk_mb * MiB, theirs), daemon=True
    )
    child.start()
    plain_s: dict[int, list[float]] = {n: [] for n in settings}
    hub_s: dict[int, list[float]] = {n: [] for n in settings}
    block_s: list[float] = []
    try:
        addr, plain_port, block_port, layout_dict = ours.recv()
        layout = Layout.from_dict(layout_dict)
        size = layout.total_bytes
        # Both receivers write into preallocated, already-touched memory (as `into=` does).
        plain_buf = torch.zeros(size, dtype=torch.uint8)
        buf = plain_buf.numpy().data.cast("B")
        into = {k: t.zero_() for k, t in layout.allocate().items()}
        nixl = Nixl(_model, args.size_mb, layout, into, plain_buf, enabled=args.nixl)
        with Iperf3(args.iperf_seconds) as ref, nixl:
            for _ in range(args.repeat):
                for n in settings:
                    plain_s[n].append(_plain_once(plain_port, buf, n))
                    hub_s[n].append(_tensorhub_once(addr, layout, into, n))
                    ref.measure(n)
                block_s.append(_block_once(block_port, size))
                nixl.measure()
    finally:
        ours.send("stop")
        child.join(timeout=5)
    res = Result("transport", command)
    details: dict[str, object] = {
        "size_bytes": size, "chunk_bytes": args.chunk_mb * MiB, "repeat": args.repeat,
        "settings": settings, "target": TARGET, "iperf3_note": ref.note,
        "iperf3_Bps": {f"{flags} -P {n}": v for (flags, n), v in ref.rates.items()},
    }  # fmt: skip
    for n in settings:
        hub, plain = _gbps(size, hub_s[n]), _gbps(size, plain_s[n])
        c_best = ref.best(n)
        ref_gbps = None if c_best is None else c_best[0] / 1e9
        flags = "" if c_best is None else c_best[1] + " "
        best = max(plain, ref_gbps or 0.0)
        conns = f"{n} conn" if n == 1 else f"{n} conns"
        res.add(f"TensorHub / better reference ({conns})", hub / best, f">= {TARGET}")
        res.add(f"TensorHub / plain socket ({conns})", hub / plain)
        res.add(f"TensorHub / iperf3 ({conns})", None if ref_gbps is None else hub / ref_gbps)
        res.add(f"TensorHub TCP ({conns})", hub, unit="GB/s")
        res.add(f"plain Python socket ({conns})", plain, unit="GB/s")
        for variant, rates in sorted(ref.rates.items()):  # each iperf3 variant, best run
            if variant[1] == n and variant[0] + " " != flags:
                res.add(f"iperf3 {variant[0]} ({conns})", max(rates) / 1e9, unit="GB/s")
        res.add(f"iperf3 {flags}({conns}, the reference)", ref_gbps, unit="GB/s")
        details[f"parallel_{n}"] = {
            "tensorhub_GBps": round(hub, 3), "plain_socket_GBps": round(plain, 3),
            "iperf3_GBps": None if ref_gbps is None else round(ref_gbps, 3),
            "iperf3_flags": flags.strip(),
            "ratio_to_better": round(hub / best, 3),
            "tensorhub_median_GBps": round(size / statistics.median(hub_s[n]) / 1e9, 3),
            "plain_median_GBps": round(size / statistics.median(plain_s[n]) / 1e9, 3),
            "tensorhub_seconds": hub_s[n], "plain_seconds": plain_s[n],
        }  # fmt: skip
    block = _gbps(size, block_s)
    one = ref.best(1)
    res.add("plain socket, 1 MiB working set (1 conn)", block, unit="GB/s")
    if one is not None:
        res.add("iperf3 / plain socket at iperf3's 1 MiB working set", one[0] / 1e9 / block)
    res.add("plain socket: model-sized / 1 MiB working set", _gbps(size, plain_s[1]) / block)
    details["plain_block_GBps"] = round(block, 3)
    rows, details["nixl"] = nixl.rows(_gbps(size, plain_s[1]))
    for name, value, unit in rows:
        res.add(name, value, unit=unit)
    details["nixl_note"] = nixl.note
    res.details = details
    res.seconds = time.monotonic() - started
    return res


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    flags = list(sys.argv[1:] if argv is None else argv)
    res = run(args, " ".join(["tensorhub bench transport", *flags]))
    for note in ("iperf3_note", "nixl_note"):
        if res.details[note]:
            print(f"note: {res.details[note]}")
    print(f"best of {args.repeat}, {res.details['size_bytes'] / MiB:.0f} MiB per transfer")
    print(table([res]))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res.to_dict(), fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
