"""A holder of GPU memory in its own process, for the CUDA IPC tests (needs a GPU):
`python -m tests.transport.ipc_holder_proc --chunk-size N [--checksum wsum64]`.

Serves `make_model(seed)` moved to the GPU as team-a/policy@VERSION over TCP and CUDA IPC
(token b"ok" only), prints `PORTS <tcp> <ipc> <sum>` once listening (sum: a wsum64 of every
chunk, for the reader to compare), then obeys lines on stdin:

- `release T`: release the version within T seconds, print `RELEASED ok` or `RELEASED late`;
- `overwrite`: after a release, fill the memory with 0xFF and print `OVERWRITTEN`;
- `leases`: print `LEASES n`.
"""

from __future__ import annotations

import argparse
import sys

import torch

from tensorhub.errors import DeadlineExceeded
from tests.transport._model import MODEL, TENANT, make_model
from transport.ipc.server import IpcControlServer
from transport.layout import Layout
from transport.server import HolderServer
from transport.store import HeldVersion, HolderStore


def _only_ok(tenant: str, model: str, version: int, token: bytes) -> bool:
    return token == b"ok"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--version", type=int, default=1)
    ap.add_argument("--chunk-size", type=int, required=True)
    ap.add_argument("--tiny", type=int, default=200)
    args = ap.parse_args()
    tensors = {k: t.cuda() for k, t in make_model(args.seed, tiny=args.tiny).items()}
    torch.cuda.synchronize()
    layout = Layout.from_tensors(tensors, chunk_size=args.chunk_size)
    held = HeldVersion.publisher(TENANT, MODEL, args.version, tensors, layout)
    store = HolderStore()
    store.add(held)
    total = sum(held.wsum64(i) for i in range(layout.num_chunks)) & ((1 << 64) - 1)
    with HolderServer(store, _only_ok) as tcp, IpcControlServer(store, _only_ok) as ipc:
        print(f"PORTS {tcp.address[1]} {ipc.address[1]} {total}", flush=True)
        for line in sys.stdin:
            cmd = line.split()
            if cmd[:1] == ["release"]:
                try:
                    store.release(held.key, float(cmd[1]))
                    print("RELEASED ok", flush=True)
                except DeadlineExceeded:
                    print("RELEASED late", flush=True)
            elif cmd == ["overwrite"]:
                for t in tensors.values():
                    t.view(torch.uint8).fill_(0xFF)
                torch.cuda.synchronize()
                print("OVERWRITTEN", flush=True)
            elif cmd == ["leases"]:
                print(f"LEASES {ipc.leases}", flush=True)


if __name__ == "__main__":
    main()
