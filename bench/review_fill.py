"""`tensorhub bench history-fill [--seconds 40] [--hub-tree PATH] [--json PATH]`: two tenants
inside their etcd budgets against one etcd's quota (issue 25, item 3), before and after.

What it guards against: at 35d0b56 a tenant's budget counted the live manifest bytes it
holds, not the history every rewrite leaves in etcd until the next compaction. With etcd's
quota at 256 MiB and two tenants of `--max-etcd-bytes 24 MiB` each, 30 publishes of a 4 MiB
manifest in 7 s raised etcd's NOSPACE alarm, and from then on the other tenant's publishes
failed with `StorageFull` (14 of 29 succeeded in 40 s).

One run, against a fresh etcd started with `--quota-backend-bytes` (`--etcd-quota-mb`, 256)
and one hub process at its default compaction interval (`bench.scale.world.World`, the hub
of `--hub-tree` when given; a hub that has `--etcd-quota-bytes` is told the same quota). The
admin creates two tenants with `max_etcd_bytes` `--tenant-mb` (24) each and every other
quota at its default (the history budget too, where the hub has one). For `--seconds` (40):

- tenant A publishes versions of one model as fast as the hub answers, each manifest about
  `--manifest-mb` (4) MiB (one tensor in as many 4 KiB chunks as make it that size: paged
  by the hub), pausing 0.05 s after a refusal;
- tenant B publishes a tiny version every `--interval` seconds (1);
- etcd's alarm list is read every 0.5 s.

Figures: B's publishes that succeeded / attempted (target 1.0), whether etcd raised NOSPACE
(target 0), how many of A's publishes landed before A was first refused, with which error
and when. Every call has a deadline; the run ends within `--seconds` plus one call's.
"""

from __future__ import annotations

import argparse
import array
import json
import os
import signal
import sys
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from bench.report import Result, emit
from bench.review_revoke import Client, attempt, create_tenant, hub_has_flag
from bench.scale.world import EtcdLimits, World
from ros.proto.tensorhub.v1 import hub_pb2 as pb

MiB = 1 << 20
CHUNK = 4096  # the smallest chunk a manifest may have: the most checksums per byte of data
BIG_CALL_SECONDS = 30.0  # A's 4 MiB publishes
SMALL_CALL_SECONDS = 10.0  # B's publishes
REFUSED_PAUSE = 0.05  # A's pause after a refusal
ALARM_EVERY = 0.5  # seconds between reads of etcd's alarm list
QUOTA_FLAG = "--etcd-quota-bytes"


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--seconds", type=float, default=40.0, help="how long the tenants publish (default 40)"
    )
    ap.add_argument(
        "--manifest-mb", type=float, default=4.0, help="tenant A's manifest size in MiB (4)"
    )
    ap.add_argument("--interval", type=float, default=1.0, help="seconds between B's publishes (1)")
    ap.add_argument(
        "--etcd-quota-mb", type=int, default=256, help="etcd's --quota-backend-bytes in MiB (256)"
    )
    ap.add_argument(
        "--tenant-mb", type=int, default=24, help="each tenant's max_etcd_bytes in MiB (24)"
    )
    ap.add_argument("--hub-tree", help="run the hub of another checkout (e.g. a worktree)")
    ap.add_argument("--json", metavar="PATH", help="write the figures as JSON (- = stdout)")


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="tensorhub bench history-fill", description=__doc__)
    add_arguments(ap)
    return ap.parse_args(argv)


@dataclass(frozen=True)
class QuotaLimits(EtcdLimits):
    """etcd's request limits (its defaults) and its backend quota."""

    quota_backend_bytes: int = 256 * MiB

    def args(self) -> list[str]:
        return [*super().args(), f"--quota-backend-bytes={self.quota_backend_bytes}"]


def big_manifest(nbytes: float) -> pb.Manifest:
    """A valid manifest of about `nbytes` serialized: one uint8 tensor in 4 KiB chunks, one
    random 8-byte checksum per chunk (nobody reads these bytes)."""
    chunks = max(1, int(nbytes) // 8 - 16)
    sums = array.array("Q", os.urandom(8 * chunks))
    size = chunks * CHUNK
    return pb.Manifest(
        tensors=[pb.TensorEntry(name="w", dtype="uint8", shape=[size], offset=0, nbytes=size)],
        total_bytes=size,
        chunk_size=CHUNK,
        chunk_xxh3=sums.tolist(),
    )


def small_manifest() -> pb.Manifest:
    return pb.Manifest(
        tensors=[pb.TensorEntry(name="w", dtype="float32", shape=[4], offset=0, nbytes=16)],
        total_bytes=16,
        chunk_size=CHUNK,
        chunk_xxh3=[0],
    )


def etcd_alarms(endpoint: str, timeout: float = 5.0) -> list[str]:
    """etcd's active alarms (`etcdctl alarm list`) through its JSON gateway; [] if none, or
    ["?"] when etcd does not answer in time."""
    req = urllib.request.Request(
        f"http://{endpoint}/v3/maintenance/alarm", data=b"{}", method="POST",
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            data: dict[str, Any] = json.loads(resp.read())
    except (OSError, ValueError):
        return ["?"]
    return [str(a.get("alarm", "")) for a in data.get("alarms", []) or []]


@dataclass
class Publisher:
    """One tenant's publishes: each outcome with its time from the start."""

    name: str
    outcomes: list[tuple[float, str]] = field(default_factory=list)

    @property
    def attempted(self) -> int:
        return len(self.outcomes)

    @property
    def landed(self) -> int:
        return sum(o == "OK" for _, o in self.outcomes)

    def first_refusal(self) -> tuple[int, str, float] | None:
        """(publishes landed before it, its error, seconds from the start), or None."""
        for i, (at, outcome) in enumerate(self.outcomes):
            if outcome != "OK":
                return i, outcome, at
        return None

    def errors(self) -> dict[str, int]:
        return dict(Counter(o for _, o in self.outcomes if o != "OK"))


def _publish_loop(
    client: Client,
    model: str,
    manifest: pb.Manifest,
    session: int,
    into: Publisher,
    t0: float,
    until: float,
    *,
    interval: float,
    timeout: float,
) -> None:
    """Publish `model` version after version until `until` (monotonic): every `interval`
    seconds (0: as fast as the hub answers, pausing after a refusal)."""
    request = pb.PublishRequest(
        model=model,
        manifest=manifest,
        holder=pb.Holder(name=f"{into.name}-0", endpoints={"tcp": "127.0.0.1:9"},
                         state=pb.COMPLETE, session_id=session),
    )  # fmt: skip
    version = 0
    next_at = time.monotonic()
    while time.monotonic() < until:
        version += 1
        request.version = version
        outcome, _ = attempt(lambda: client.call("Publish", request, timeout=timeout))
        into.outcomes.append((time.monotonic() - t0, outcome))
        if interval > 0:
            next_at += interval
            time.sleep(max(0.0, min(next_at, until) - time.monotonic()))
        elif outcome != "OK":
            time.sleep(REFUSED_PAUSE)


@dataclass
class Alarms:
    """etcd's alarm list, read every `ALARM_EVERY` s: when NOSPACE was first seen."""

    nospace_at: float | None = None
    seen: set[str] = field(default_factory=set)


def _watch_alarms(endpoint: str, into: Alarms, t0: float, stop: threading.Event) -> None:
    while not stop.wait(ALARM_EVERY):
        found = etcd_alarms(endpoint)
        into.seen.update(a for a in found if a != "?")
        if "NOSPACE" in found and into.nospace_at is None:
            into.nospace_at = time.monotonic() - t0
            _log(f"NOSPACE at +{into.nospace_at:.1f} s")


def fill(args: argparse.Namespace) -> dict[str, Any]:
    """The run: A floods, B publishes steadily, etcd's alarms are watched."""
    quota = args.etcd_quota_mb * MiB
    flags = [QUOTA_FLAG, str(quota)] if hub_has_flag(args.hub_tree, QUOTA_FLAG) else []
    manifest = big_manifest(args.manifest_mb * MiB)
    out: dict[str, Any] = {"manifest_bytes": manifest.ByteSize(), "hub_flags": flags}
    with World(flags, tree=args.hub_tree, limits=QuotaLimits(quota_backend_bytes=quota)) as world:
        admin = Client(world.address, world.admin)
        clients = [admin]
        try:
            # only A and B: the world's own tenant (default budget) would count in a warning
            admin.call("DeleteTenant", pb.DeleteTenantRequest(name=world.tenant))
            quotas = pb.Quotas(max_etcd_bytes=args.tenant_mb * MiB)
            a_reply = create_tenant(admin, "fill-a", quotas)
            b_reply = create_tenant(admin, "fill-b", quotas)
            out["create_warning"] = b_reply.warning or a_reply.warning
            a = Client(world.address, a_reply.token, "fill-a")
            b = Client(world.address, b_reply.token, "fill-b")
            clients += [a, b]
            ttl = int(args.seconds) + 120
            a_session = a.call("OpenSession", pb.OpenSessionRequest(ttl_seconds=ttl)).session_id
            b_session = b.call("OpenSession", pb.OpenSessionRequest(ttl_seconds=ttl)).session_id
            flood, steady, alarms = Publisher("a"), Publisher("b"), Alarms()
            stop = threading.Event()
            t0 = time.monotonic()
            until = t0 + args.seconds
            threads = [
                threading.Thread(
                    target=_publish_loop,
                    args=(a, "flood", manifest, a_session, flood, t0, until),
                    kwargs={"interval": 0.0, "timeout": BIG_CALL_SECONDS},
                    daemon=True,
                ),
                threading.Thread(
                    target=_publish_loop,
                    args=(b, "steady", small_manifest(), b_session, steady, t0, until),
                    kwargs={"interval": args.interval, "timeout": SMALL_CALL_SECONDS},
                    daemon=True,
                ),
                threading.Thread(
                    target=_watch_alarms,
                    args=(world.etcd_endpoint, alarms, t0, stop),
                    daemon=True,
                ),
            ]
            for thread in threads:
                thread.start()
            for thread in threads[:2]:
                thread.join(args.seconds + BIG_CALL_SECONDS + 10)
            stop.set()
            threads[2].join(10)
            out["nospace_at"] = alarms.nospace_at
            out["alarms_seen"] = sorted(alarms.seen)
            out["alarms_at_end"] = etcd_alarms(world.etcd_endpoint)
            out["status_at_end"] = world.status()
        finally:
            for client in clients:
                client.close()
    out["a"], out["b"] = flood, steady
    return out


def run(args: argparse.Namespace) -> Result:
    defaults = parse([])
    shown = [f"--{k.replace('_', '-')} {v:g}" for k, v in vars(args).items()
             if k not in ("hub_tree", "json") and v != getattr(defaults, k)]  # fmt: skip
    if args.hub_tree:
        shown.append(f"--hub-tree {args.hub_tree}")
    result = Result("history-fill", " ".join(["tensorhub bench history-fill", *shown]))
    started = time.monotonic()
    found = fill(args)
    flood: Publisher = found["a"]
    steady: Publisher = found["b"]
    nospace = found["nospace_at"] is not None or "NOSPACE" in found["alarms_at_end"]
    result.add("B publishes succeeded / attempted",
               steady.landed / steady.attempted if steady.attempted else None, ">= 1")  # fmt: skip
    result.add("etcd NOSPACE raised", int(nospace), "<= 0")
    result.add("B publishes attempted", steady.attempted, unit="publishes")
    result.add("A publishes landed in all", flood.landed, unit="publishes")
    refused = flood.first_refusal()
    if refused is None:
        result.add("A publishes landed, never refused", flood.landed, unit="publishes")
    else:
        before, error, at = refused
        result.add("A publishes landed before A was first refused", before, unit="publishes")
        result.add(f"A first refused: {error}", at, unit="s from start")
    if found["nospace_at"] is not None:
        result.add("NOSPACE alarm first seen", found["nospace_at"], unit="s from start")
    result.details = {
        "hub_tree": args.hub_tree,
        "hub_flags": found["hub_flags"],
        "manifest_bytes": found["manifest_bytes"],
        "create_warning": found.get("create_warning", ""),
        "a": {"attempted": flood.attempted, "landed": flood.landed, "errors": flood.errors()},
        "b": {"attempted": steady.attempted, "landed": steady.landed, "errors": steady.errors()},
        "alarms_seen": found["alarms_seen"],
        "alarms_at_end": found["alarms_at_end"],
        "etcd_at_end": found["status_at_end"],
    }
    result.seconds = time.monotonic() - started
    return result


def _log(message: str) -> None:
    print(f"bench history-fill: {message}", file=sys.stderr, flush=True)


def _terminated(signum: int, frame: object) -> None:
    """SIGTERM (e.g. `timeout`): unwind, so the hub and etcd are stopped."""
    raise SystemExit(128 + signum)


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGTERM, _terminated)
    args = parse(argv)
    result = run(args)
    print(json.dumps({k: result.details[k] for k in ("a", "b", "alarms_seen")}),
          file=sys.stderr)  # fmt: skip
    return emit([result], args.json)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
