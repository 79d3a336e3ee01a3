"""A reader in a layout, as a process of its own, for tests/ros/test_layouts.py: reads its
TP-`ranks` blocks of policy@1 with `fetch_slices(layout=...)`, prints one JSON line (its
holder name, the bytes per source, the sources given up on, whether it serves, an xxh3 per
block), then serves them until its stdin closes (at most `--hold` seconds).

`--corrupt`: its holder server flips a byte of every chunk it sends (`chaos.holder_faults`);
`--chunk-delay S`: it sleeps S before each chunk it sends and prints `sent` after each one,
so a test can kill it mid-read; `--ttl`: its session's TTL.
"""

from __future__ import annotations

import argparse
import json
import select
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import ros
from chaos.holder_faults import Fault
from ros.client.hooks import ClientHooks
from tests.ros.helpers import digest
from tests.ros.layout_model import slices_for
from transport.wire import ChunkHeader


class Announcing(Fault):
    """A `Fault` that says on stdout each chunk it sent."""

    def __call__(
        self, conn: socket.socket, header: ChunkHeader, views: list[memoryview], complete: bool
    ) -> None:
        super().__call__(conn, header, views, complete)
        print("sent", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("hub")
    ap.add_argument("tenant")
    ap.add_argument("token")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--layout", default="tp2")
    ap.add_argument("--corrupt", action="store_true")
    ap.add_argument("--chunk-delay", type=float, default=0.0)
    ap.add_argument("--ttl", type=int, default=10)
    ap.add_argument("--hold", type=float, default=60.0)
    args = ap.parse_args()
    fault = Announcing(corrupt=args.corrupt, chunk_delay=args.chunk_delay)
    hooks = ClientHooks(send=fault) if args.corrupt or args.chunk_delay else ClientHooks()
    with ros.connect(
        args.hub, tenant=args.tenant, token=args.token, hooks=hooks, session_ttl=args.ttl
    ) as hub:
        out, slices = slices_for(args.rank, args.ranks)
        got = hub.fetch_slices("policy", 1, slices=slices, layout=args.layout, timeout=30)
        report = {
            "name": hub.holder_name,
            "bytes": got.bytes_per_source,
            "served": got.served,
            "failed": got.failed_sources,
            "digest": digest(out),
        }
        print(json.dumps(report), flush=True)
        select.select([sys.stdin], [], [], args.hold)  # until the test closes our stdin
        time.sleep(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
