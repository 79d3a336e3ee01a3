"""A reader in its own process, for tests that freeze it: `python -m tests.transport.reader_proc`.

Fetches `make_model(seed)` as team-a/policy@1 from the holder at 127.0.0.1:PORT, prints
`STARTED` once some but not all chunks arrived (so a test can SIGSTOP it mid-fetch), then
the fetch's outcome as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import threading
import time

from tests.transport._model import MODEL, TENANT, make_model
from transport.layout import Layout
from transport.reader import Source, fetch
from transport.store import HeldVersion
from transport.topology import Topology


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--tiny", type=int, default=2000)
    ap.add_argument("--large-elems", type=int, default=60_000)
    ap.add_argument("--chunk-size", type=int, required=True)
    ap.add_argument("--stall", type=float, default=5.0)
    ap.add_argument("--rate-floor", type=float, required=True)
    args = ap.parse_args()
    model = make_model(args.seed, tiny=args.tiny, large_elems=args.large_elems)
    layout = Layout.from_tensors(model, chunk_size=args.chunk_size)
    dest = HeldVersion.reader(TENANT, MODEL, 1, layout, layout.allocate())
    done = threading.Event()

    def announce() -> None:
        while not done.is_set():
            if 0 < len(dest.missing()) < layout.num_chunks:
                print("STARTED", flush=True)
                return
            time.sleep(0.0005)

    threading.Thread(target=announce, daemon=True).start()
    try:
        stats = fetch(
            TENANT, MODEL, 1, layout, dest, [Source("h", "127.0.0.1", args.port)],
            token=b"t", deadline=time.monotonic() + 60, me=Topology(), parallel=1,
            stall_timeout=args.stall, rate_floor=args.rate_floor,
        )  # fmt: skip
        out = {"complete": dest.complete, "failed": stats.failed_sources}
    except Exception as exc:
        out = {"complete": False, "error": repr(exc)}
    done.set()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
