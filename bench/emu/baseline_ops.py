"""Participant commands that do not go through the hub: the plain-socket ceiling, the
transport data plane with a fixed source list (the parameter-server pattern and the
failover run), and a `torch.distributed` (gloo) broadcast.

Each command is a function of the participant's own address and the command's arguments,
returning a JSON-safe dict; times are `time.monotonic()` values, which every namespace on
this machine shares, so the orchestrator can compare them across hosts.
"""

from __future__ import annotations

import datetime
import os
import socket
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from bench.emu.model import digest, flat, make_model, model_layout
from bench.open_verifier import allow_all
from transport.backend import TransportKind
from transport.layout import Layout
from transport.reader import DEFAULT_RATE_FLOOR, Source, fetch
from transport.server import HolderServer
from transport.store import HeldVersion, HolderStore
from transport.topology import Topology
from transport.transports import ReaderBackends

PIECE = 1 << 20
_keep: list[Any] = []  # servers and their memory live as long as the participant


def plain_listen(ip: str, nbytes: int) -> dict[str, Any]:
    """Serve `nbytes` zero bytes to every connection, with one sendall: the ceiling."""
    server = socket.create_server((ip, 0))
    payload = memoryview(bytearray(nbytes))

    def loop() -> None:
        while True:
            conn, _ = server.accept()
            threading.Thread(target=_send_all, args=(conn, payload), daemon=True).start()

    threading.Thread(target=loop, daemon=True).start()
    _keep.append(server)
    return {"port": server.getsockname()[1]}


def _send_all(conn: socket.socket, payload: memoryview) -> None:
    with conn:
        conn.sendall(payload)


def plain_recv(ip: str, host: str, port: int, nbytes: int) -> dict[str, Any]:
    """Receive `nbytes` from a `plain_listen` peer; the time it took."""
    buf = memoryview(bytearray(nbytes))
    start = time.monotonic()
    with socket.create_connection((host, port), timeout=120) as sock:
        pos = 0
        while pos < nbytes:
            got = sock.recv_into(buf[pos : pos + PIECE])
            if not got:
                raise ConnectionError(f"peer closed after {pos} of {nbytes} bytes")
            pos += got
    end = time.monotonic()
    return {"t0": start, "t1": end, "seconds": end - start}


def serve(ip: str, nbytes: int, seed: int, chunk: int, transport: str = "tcp") -> dict[str, Any]:
    """Hold the model (version 1 of bench/model) on a bare HolderServer (no hub, no tokens);
    with `transport` "nixl" also on a bare `NixlHolder` beside it. `port` is where
    `transport` reads it (the NIXL control port for "nixl"), `tcp_port` the TCP server's."""
    tensors = make_model(nbytes, seed)
    layout = Layout.from_tensors(tensors, chunk_size=chunk)
    store = HolderStore()
    held = HeldVersion.publisher("bench", "model", 1, tensors, layout)
    held.precompute_checksums()
    store.add(held)
    server = HolderServer(store, allow_all, ip, 0).start()
    _keep.append((server, store))
    port = tcp_port = server.address[1]
    if TransportKind(transport) is TransportKind.NIXL:
        from transport.nixl.holder import NixlHolder  # imports NIXL only for a NIXL run

        nixl = NixlHolder(store, allow_all, ip, 0).start()
        store.watch(nixl.register, nixl.release)
        _keep.append(nixl)
        port = nixl.address[1]
    return {"port": port, "tcp_port": tcp_port, "digest": digest(tensors)}


def tfetch(
    ip: str,
    sources: list[list[Any]],
    nbytes: int,
    chunk: int,
    parallel: int = 4,
    rate_floor: float = DEFAULT_RATE_FLOOR,
    transport: str = "tcp",
) -> dict[str, Any]:
    """Fetch the model from exactly `sources` ([id, host, port] each, the port `serve`
    gave for `transport`) with transport.fetch, over `transport` ("tcp" or "nixl").
    `rate_floor` 0 turns the reader's floor off (a baseline whose one source is shared by
    so many connections that each gets less than the floor)."""
    layout = model_layout(nbytes, chunk)
    tensors = layout.allocate()
    dest = HeldVersion.reader("bench", "model", 1, layout, tensors)
    kind = TransportKind(transport)
    srcs = [Source(str(h), str(a), int(p), Topology(), transport=kind) for h, a, p in sources]
    readers = ReaderBackends((kind, TransportKind.TCP))
    readers.get(kind)  # NIXL's agent (a UCX context) is made before the clock starts
    start = time.monotonic()
    try:
        stats = fetch(
            "bench", "model", 1, layout, dest, srcs, token=b"", deadline=start + 300,
            me=Topology(), parallel=parallel, stall_timeout=5.0, rate_floor=rate_floor,
            readers=readers,
        )  # fmt: skip
        end = time.monotonic()
    finally:
        readers.close()
    return {
        "t0": start,
        "t1": end,
        "digest": digest(tensors),
        "bytes_per_source": stats.bytes_per_source,
        "refetched_bytes": stats.refetched_bytes,
        "discarded_bytes": stats.discarded_bytes,
        "failed_sources": stats.failed_sources,
        "transports": stats.transports,
        "fallbacks": stats.fallbacks,
    }


def gloo(
    ip: str, master: str, port: int, rank: int, world: int, nbytes: int, seed: int
) -> dict[str, Any]:
    """One `dist.broadcast` of the model's bytes from rank 0 over gloo (group built here)."""
    os.environ["GLOO_SOCKET_IFNAME"] = "eth0"
    size = model_layout(nbytes, 1 << 20).total_bytes
    buf = flat(nbytes, seed) if rank == 0 else torch.zeros(size, dtype=torch.uint8)
    init0 = time.monotonic()
    dist.init_process_group(
        "gloo", init_method=f"tcp://{master}:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )  # fmt: skip
    try:
        dist.barrier()
        start = time.monotonic()
        dist.broadcast(buf, src=0)
        end = time.monotonic()
    finally:
        dist.destroy_process_group()
    return {"init": start - init0, "t0": start, "t1": end, "digest": digest(buf)}
