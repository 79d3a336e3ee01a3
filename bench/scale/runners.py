"""`tensorhub bench scale`'s runners: each part run from the parsed flags, returning the
dict its rows are read from (`bench.scale.rows`).

Each runner starts what its part needs (etcd, hubs, the ceiling server, client
processes) and stops it on the way out, a `with` or a `finally` each; the measuring itself
is the part's module (`bench.scale.sessions`, `herd`, `shards`, `reconnect`, ...). Apart
from the flags (`bench.scale.args`) and the report, so that a part is run the same way
from `tensorhub bench scale` and from `tensorhub bench all`. Progress goes to stderr
(`log`), the figures to the report.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def run_clients(args: argparse.Namespace) -> dict[str, Any]:
    """At each N: the ceiling, then the hub, measured by the same client processes."""
    from bench.scale.clients import Fleet
    from bench.scale.load import RoundSpec
    from bench.scale.sessions import ceiling_round, hub_round, summary
    from consistency.embedded import EtcdCluster

    rounds = []
    with EtcdCluster(size=1, extra_args=etcd_limits(args).args()) as etcd:
        for n in [int(x) for x in args.clients.split(",") if x]:
            spec = RoundSpec(clients=n, versions=args.versions, gap=args.gap,
                             workers=args.workers, ttl=args.ttl,
                             connect_seconds=args.connect_seconds)  # fmt: skip
            fleet = Fleet(args.workers)
            try:
                for name in ("ceiling", "hub"):
                    t0 = time.monotonic()
                    if name == "ceiling":
                        r = ceiling_round(spec, log, fleet)
                    else:
                        r = hub_round(etcd.endpoints, spec, log, tree=args.hub_tree, fleet=fleet)
                    r["round_s"] = round(time.monotonic() - t0, 1)
                    log(summary(r))
                    rounds.append(r)
                    if r.get("fleet_broken"):  # the next round gets fresh processes
                        fleet.close()
                        fleet = Fleet(args.workers)
            finally:
                fleet.close()
    return {"rounds": rounds, "hub_tree": args.hub_tree}


def etcd_limits(args: argparse.Namespace) -> Any:
    from bench.scale.world import EtcdLimits

    return EtcdLimits(args.max_txn_ops, args.max_request_bytes)


def replicas(args: argparse.Namespace) -> tuple[int, ...]:
    return tuple(int(x) for x in args.replicas.split(",") if x)


def run_herd(args: argparse.Namespace) -> dict[str, Any]:
    """At each replica count: the ceiling, then the hub, with the same client processes."""
    from bench.scale.clients import Fleet
    from bench.scale.herd import HerdSpec, ceiling_herd, herd_round, summary
    from bench.scale.procs import ServerStartError
    from bench.scale.world import World

    limits = etcd_limits(args)
    spec = HerdSpec(
        clients=args.herd_clients, workers=args.workers, ttl=args.ttl,
        hold=float(args.ttl) if args.herd_hold is None else args.herd_hold,
        connect_seconds=args.connect_seconds, open_seconds=args.herd_open_seconds,
    )  # fmt: skip
    log(f"  etcd at {limits.describe()}")
    rounds = []
    fleet = Fleet(args.workers, prober=False)
    try:
        for r in replicas(args):
            for name in ("ceiling", "hub"):
                t0 = time.monotonic()
                if name == "ceiling":
                    res = ceiling_herd(r, spec, fleet, log)
                else:
                    world = World(max_sessions=2 * spec.clients + 64, replicas=r,
                                  tree=args.hub_tree, limits=limits, metrics=True)  # fmt: skip
                    try:
                        with world:
                            res = herd_round("hub", world.hubs, world.token, spec, fleet, log)
                    except ServerStartError as exc:
                        res = {"server": "hub", "replicas": r, "failed": str(exc)}
                res["round_s"] = round(time.monotonic() - t0, 1)
                log(summary(res))
                rounds.append(res)
                if res.get("fleet_broken"):  # the next round gets fresh processes
                    fleet.close()
                    fleet = Fleet(args.workers, prober=False)
    finally:
        fleet.close()
    return {
        "clients": spec.clients,
        "rounds": rounds,
        "hub_tree": args.hub_tree,
        "limits": {"max_txn_ops": limits.max_txn_ops,
                   "max_request_bytes": limits.max_request_bytes},
    }  # fmt: skip


def run_shards(args: argparse.Namespace) -> dict[str, Any]:
    from bench.scale import shards

    cases = tuple(c for c in args.shard_cases.split(",") if c)
    unknown = set(cases) - set(shards.CASES)
    if unknown:
        raise SystemExit(f"unknown shard cases: {', '.join(sorted(unknown))}")
    return shards.run(
        args.shards, args.ranks, args.inflight, replicas(args), sequential=args.sequential,
        group_tensors=args.group_tensors, group_frame=args.group_frame, cases=cases,
        workers=args.workers, timeout=args.shard_timeout, tree=args.hub_tree,
        limits=etcd_limits(args), log=log,
    )  # fmt: skip


def run_reconnect(args: argparse.Namespace) -> dict[str, Any]:
    from bench.scale import reconnect

    out = reconnect.run(
        args.reconnect_clients, workers=args.reconnect_workers, ttl=args.ttl,
        observe=args.reconnect_observe, concurrency=args.reconnect_connecting,
        tree=args.hub_tree, limits=etcd_limits(args), log=log,
    )  # fmt: skip
    log(reconnect.summary(out))
    return out
