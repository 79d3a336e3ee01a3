"""A NIXL holder in its own process: `python -m tests.transport.nixl_holder_proc`.

Serves `nixl_model(seed, mib)` as team-a/policy@1 to readers whose token is `--token`, and
prints `PORT <n>` once listening. Then it reads commands on stdin, one per line:
`corrupt` (flip bytes of the held memory: what a holder that broke the mutability contract
serves), `release <timeout>` (prints `RELEASED` or `RELEASE <error class>`), `registered`
(prints `REGISTERED <versions registered with NIXL>`), `exit`.
`--on-begin kill|stop` makes it SIGKILL or SIGSTOP itself right after it said `go` to the
`--nth-begin` READ (default: the first): a holder that dies or freezes mid-read.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import sys

import torch

from tests.transport._model import MODEL, TENANT
from transport.layout import Layout
from transport.nixl.holder import NixlHolder, _Registration
from transport.store import HeldVersion, HolderStore

CHUNK = 1 << 20


def nixl_model(seed: int, mib: int) -> dict[str, torch.Tensor]:
    """Two float32 tensors of `mib` MiB together, and a few small ones of odd sizes."""
    g = torch.Generator().manual_seed(seed)
    half = mib * (1 << 20) // 8
    out = {f"big.{i}": torch.randn(half, generator=g) for i in range(2)}
    for i in range(5):
        out[f"small.{i}"] = torch.randn(1 + 37 * i, generator=g)
    return out


class _SignalOnBegin(NixlHolder):
    """A holder that signals itself once it has told a reader `go`."""

    def __init__(self, *args: object, sig: signal.Signals, nth: int, **kw: object) -> None:
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self._sig, self._left = sig, nth

    def _begin(
        self, conn: socket.socket, reg: _Registration, token: bytes
    ) -> contextlib.ExitStack | None:
        batch = super()._begin(conn, reg, token)
        self._left -= 1
        if not self._left:
            os.kill(os.getpid(), self._sig)
        return batch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--mib", type=int, default=8)
    ap.add_argument("--token", default="good")
    ap.add_argument("--on-begin", choices=["kill", "stop"], default=None)
    ap.add_argument("--nth-begin", type=int, default=1)
    args = ap.parse_args()
    tensors = nixl_model(args.seed, args.mib)
    layout = Layout.from_tensors(tensors, chunk_size=CHUNK)
    store = HolderStore()
    held = HeldVersion.publisher(TENANT, MODEL, 1, tensors, layout)
    store.add(held)
    token: bytes = args.token.encode()

    def verifier(tenant: str, model: str, version: int, presented: bytes) -> bool:
        return presented == token

    if args.on_begin:
        sig = signal.SIGKILL if args.on_begin == "kill" else signal.SIGSTOP
        server: NixlHolder = _SignalOnBegin(store, verifier, sig=sig, nth=args.nth_begin).start()
    else:
        server = NixlHolder(store, verifier).start()
    store.watch(server.register, server.release)
    print(f"PORT {server.address[1]}", flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if cmd == ["corrupt"]:
            for t in tensors.values():
                t.view(torch.uint8)[::4096] ^= 0xFF
            print("CORRUPTED", flush=True)
        elif cmd[:1] == ["release"]:
            try:
                store.release(held.key, float(cmd[1]))
                print("RELEASED", flush=True)
            except Exception as exc:
                print(f"RELEASE {type(exc).__name__}", flush=True)
        elif cmd == ["registered"]:
            print(f"REGISTERED {server.registered()}", flush=True)
        elif cmd == ["exit"]:
            break
    server.stop()


if __name__ == "__main__":
    main()
