"""A TensorHub client in a process of its own that serves over NIXL, for tests/ros/test_nixl_sdk.py.

    python -m tests.ros.nixl_client_proc --hub ADDR --tenant T --token TOK --role publish|fetch

`publish` publishes `model@1` (`nixl_weights`, deterministic); `fetch` fetches it (and
checks it). Either way the client then holds the version and serves it, over TCP and NIXL
(`transports=["nixl"]`), under the UCX settings of its environment, and prints
`READY <endpoints as JSON>`. Each line on stdin is a command: `release` releases the version
(answers `RELEASED`); end of input closes the client. The test kills or stops it at will.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

import ros

MODEL = "nixl-policy"


def nixl_weights(mib: int) -> dict[str, torch.Tensor]:
    """`mib` MiB of float32 in four tensors, the same in every process."""
    g = torch.Generator().manual_seed(23)
    per = mib * (1 << 20) // 4 // 4
    return {f"layer{i}.weight": torch.randn(per, generator=g) for i in range(4)}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--hub", required=True)
    p.add_argument("--tenant", required=True)
    p.add_argument("--token", required=True)
    p.add_argument("--role", choices=("publish", "fetch"), required=True)
    p.add_argument("--mib", type=int, default=16)
    p.add_argument("--name", default=None)
    args = p.parse_args()
    with ros.connect(
        args.hub, tenant=args.tenant, token=args.token, transports=["nixl"], name=args.name,
        session_ttl=5,
    ) as hub:  # fmt: skip
        weights = nixl_weights(args.mib)
        if args.role == "publish":
            handle: ros.Publication | ros.Held = hub.publish(MODEL, 1, weights)
        else:
            handle = hub.fetch(MODEL, 1, timeout=60)
            assert all(torch.equal(handle.tensors[k], v) for k, v in weights.items())
        (record,) = [h for h in hub.holders(MODEL, 1) if h.holder == hub.holder_name]
        print("READY", json.dumps(dict(record.endpoints)), flush=True)
        for line in sys.stdin:
            if line.strip() == "release":
                handle.release(force=True)
                print("RELEASED", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
