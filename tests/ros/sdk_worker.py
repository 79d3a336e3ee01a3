"""A reader process for SDK tests: fetches MODEL@V through the SDK and reports a digest.

Run as `python tests/ros/sdk_worker.py HUB TENANT TOKEN MODEL VERSION [--hold SECONDS]`;
prints one JSON line with the version and an xxh3 of every tensor, then keeps serving what
it fetched for `--hold` seconds (so others can read from it) before closing.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import ros
from tests.ros.helpers import digest


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("hub")
    ap.add_argument("tenant")
    ap.add_argument("token")
    ap.add_argument("model")
    ap.add_argument("version")
    ap.add_argument("--hold", type=float, default=0.0)
    ap.add_argument("--host", default="")
    args = ap.parse_args()
    version: int | str = int(args.version) if args.version.isdigit() else args.version
    with ros.connect(
        args.hub, tenant=args.tenant, token=args.token, topology={"host": args.host}
    ) as hub:
        held = hub.fetch(args.model, version, timeout=60)
        report = {"version": held.version, "digest": digest(held.tensors)}
        report["bytes"] = held.stats.bytes_per_source
        print(json.dumps(report), flush=True)
        time.sleep(args.hold)
    return 0


if __name__ == "__main__":
    sys.exit(main())
