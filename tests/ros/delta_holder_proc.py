"""A reader in its own process that becomes a holder of a delta, for tests that kill or
freeze it (issue 22, item 6).

Run from the repository root as
`python -m tests.ros.delta_holder_proc HUB TENANT TOKEN MODEL BASE VERSION --ttl T`:
fetches MODEL@BASE, then MODEL@VERSION into the same memory (applying the delta, which
makes this process a holder of `{MODEL}.delta`@VERSION), prints one JSON line (`holder`,
`delta_chunks`), then serves until its stdin closes, and closes the client.
"""

from __future__ import annotations

import argparse
import json
import sys

import ros


def main() -> int:
    ap = argparse.ArgumentParser()
    for name in ("hub", "tenant", "token", "model"):
        ap.add_argument(name)
    ap.add_argument("base", type=int)
    ap.add_argument("version", type=int)
    ap.add_argument("--ttl", type=int, default=10)
    args = ap.parse_args()
    hub = ros.connect(args.hub, tenant=args.tenant, token=args.token, session_ttl=args.ttl)
    try:
        first = hub.fetch(args.model, args.base)
        first.release()
        held = hub.fetch(args.model, args.version, into=first.tensors)
        chunks = held.delta.chunks if held.delta is not None else 0
        print(json.dumps({"holder": hub.holder_name, "delta_chunks": chunks}), flush=True)
        sys.stdin.read()  # serve until the test closes our stdin
    finally:
        hub.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
