"""A publisher in its own process, for tests that freeze or kill it (issue 25).

Run from the repository root as
`python -m tests.ros.publisher_proc HUB TENANT TOKEN MODEL VERSION --seed S --ttl T`:
publishes `make_model(S)` as MODEL@VERSION with a session of T seconds, prints one JSON line
(`holder`, `session`), then serves it until its stdin closes, and closes the client.
"""

from __future__ import annotations

import argparse
import json
import sys

import ros
from tests.ros.helpers import make_model


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("hub")
    ap.add_argument("tenant")
    ap.add_argument("token")
    ap.add_argument("model")
    ap.add_argument("version", type=int)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--ttl", type=int, default=10)
    args = ap.parse_args()
    hub = ros.connect(args.hub, tenant=args.tenant, token=args.token, session_ttl=args.ttl)
    try:
        hub.publish(args.model, args.version, make_model(args.seed))
        print(json.dumps({"holder": hub.holder_name, "session": hub.session.id}), flush=True)
        sys.stdin.read()  # serve until the test closes our stdin
    finally:
        hub.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
