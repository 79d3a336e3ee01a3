"""A holder in its own process, for kill/stop tests: `python -m tests.transport.holder_proc`.

Serves `make_model(seed)` as team-a/policy@VERSION and prints `PORT <n>` once listening.
`--chunk-delay` throttles sending so a test can SIGKILL or SIGSTOP it mid-transfer.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from chaos.holder_faults import Fault
from tests.transport._model import MODEL, TENANT, make_model
from tests.transport.open_verifier import allow_all
from transport.layout import Layout
from transport.server import HolderServer, send_chunk
from transport.store import HeldVersion, HolderStore


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--version", type=int, default=1)
    ap.add_argument("--chunk-size", type=int, required=True)
    ap.add_argument("--tiny", type=int, default=2000)
    ap.add_argument("--chunk-delay", type=float, default=0.0)
    args = ap.parse_args()
    tensors = make_model(args.seed, tiny=args.tiny)
    layout = Layout.from_tensors(tensors, chunk_size=args.chunk_size)
    store = HolderStore()
    store.add(HeldVersion.publisher(TENANT, MODEL, args.version, tensors, layout))
    fault = Fault(chunk_delay=args.chunk_delay) if args.chunk_delay else None
    server = HolderServer(store, allow_all, send=fault or send_chunk).start()
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    print(f"PORT {server.address[1]}", flush=True)
    done.wait()
    server.stop()
    sys.exit(0)


if __name__ == "__main__":
    main()
