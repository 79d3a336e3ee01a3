"""A flood of hub sessions that are never renewed, from a process of its own (issue 25).

Run from the repository root as
`python -m tests.ros.lease_flood HUB TENANT TOKEN --count N --waves W --gap S --ttl T`:
opens N sessions with `OpenSession(ttl_seconds=T)` in W waves S seconds apart (each wave
all at once, over one channel) and renews none of them, so every one expires T seconds after
it opened; then prints one JSON line: how many opened, each refusal by name, and the seconds
each wave took. Its own process, so the flood's client work does not share the test's GIL.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import Counter

import grpc

from ros.errors import ERROR_METADATA_KEY
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from ros.proto.tensorhub.v1 import hub_pb2_grpc


def _name(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        for key, value in exc.trailing_metadata() or ():
            if key == ERROR_METADATA_KEY:
                return str(value)
        return str(exc.code().name)
    return type(exc).__name__


async def flood(args: argparse.Namespace) -> dict[str, object]:
    md = (("authorization", f"Bearer {args.token}"), ("tensorhub-tenant", args.tenant))
    refused: Counter[str] = Counter()
    opened = 0
    waves: list[float] = []
    per_wave = args.count // args.waves
    async with grpc.aio.insecure_channel(args.hub) as channel:
        stub = hub_pb2_grpc.TensorHubStub(channel)  # type: ignore[no-untyped-call]
        for wave in range(args.waves):
            started = time.monotonic()
            calls = [
                stub.OpenSession(
                    pb.OpenSessionRequest(ttl_seconds=args.ttl), metadata=md, timeout=30
                )
                for _ in range(per_wave)
            ]
            for result in await asyncio.gather(*calls, return_exceptions=True):
                if isinstance(result, BaseException):
                    refused[_name(result)] += 1
                else:
                    opened += 1
            waves.append(round(time.monotonic() - started, 3))
            if wave < args.waves - 1:
                await asyncio.sleep(max(0.0, args.gap - (time.monotonic() - started)))
    return {"opened": opened, "refused": dict(refused), "waves": waves}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("hub")
    ap.add_argument("tenant")
    ap.add_argument("token")
    ap.add_argument("--count", type=int, default=2000)
    ap.add_argument("--waves", type=int, default=4)
    ap.add_argument("--gap", type=float, default=1.0)
    ap.add_argument("--ttl", type=int, default=2)
    print(json.dumps(asyncio.run(flood(ap.parse_args()))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
