"""`tensorhub bench metadata`: publish-to-visible latency at 100 watchers, and `latest`
calls per second through two hub replicas.

Four emulated hosts open 25 SDK watches each (100 in all), alternating between two hub
replicas over one etcd; a fifth host publishes `VERSIONS` small versions. The watchers are
rollouts waiting for weights, so they use `watch(versions_only=True)`; a second round with
unfiltered watches (holder events too) is reported for comparison, without a target.
Latency: from the start of `publish` to the moment each watcher's stream yields the new
version (every namespace shares CLOCK_MONOTONIC). Then the four hosts call `latest` from
4 threads each for `LOAD_SECONDS`, and, as the ceiling on the same channels, the gRPC
health check (an RPC that does no work). Target: p99 <= 50 ms.
"""

from __future__ import annotations

import time

from bench.common import MODEL, Options
from bench.emu.cluster import Cluster, settle
from bench.emu.control import broadcast
from bench.report import Result

WATCHERS_PER_HOST = 25
HOSTS = 4
VERSIONS = 40
UNFILTERED_VERSIONS = 20  # a second round with watches that also receive holder events
GAP = 0.05
LOAD_SECONDS = 3.0
THREADS = 4
TINY = 128 * 1024


def _percentile(values: list[float], q: float) -> float:
    ranked = sorted(values)
    return ranked[min(len(ranked) - 1, round(q * (len(ranked) - 1)))]


def _round(c: Cluster, first: int, count: int, versions_only: bool) -> dict[int, list[float]]:
    """Open the watches, publish versions first..first+count-1, and return each version's
    publish-to-visible latencies (ms) over every watcher."""
    publisher, watchers = c.parts[0], c.parts[1:]
    broadcast(watchers, "watchers", 120, model=MODEL, count=WATCHERS_PER_HOST,
              versions_only=versions_only)  # fmt: skip
    settle(0.5)
    published: dict[int, float] = {}
    for v in range(first, first + count):
        answer = publisher.call("publish", model=MODEL, version=v, nbytes=TINY, seed=v,
                                chunk=64 * 1024)  # fmt: skip
        published[v] = answer["t0"]
        if v > 2:
            publisher.call("release", version=v - 2)
        time.sleep(GAP)
    settle(1.0)
    seen = broadcast(watchers, "seen_versions", 60)
    broadcast(watchers, "stop_watchers", 60)
    by_version: dict[int, list[float]] = {}
    for reply in seen:
        for v, t in reply["seen"]:
            if v in published:
                by_version.setdefault(v, []).append((t - published[v]) * 1000)
    return by_version


def run(opts: Options) -> Result:
    res = Result("metadata", "tensorhub bench metadata" + opts.flags())
    started = time.monotonic()
    with Cluster({1: 1 + HOSTS}, opts.rate_mbit, replicas=2) as c:
        by_version = _round(c, 1, VERSIONS, versions_only=True)
        unfiltered = _round(c, VERSIONS + 1, UNFILTERED_VERSIONS, versions_only=False)
        watchers = c.parts[1:]
        load = broadcast(watchers, "rpc_load", 60, model=MODEL, threads=THREADS,
                         seconds=LOAD_SECONDS, kind="latest")  # fmt: skip
        ceiling = broadcast(watchers, "rpc_load", 60, model=MODEL, threads=THREADS,
                            seconds=LOAD_SECONDS, kind="health")  # fmt: skip
    lat = [x for xs in by_version.values() for x in xs]
    every = [x for xs in unfiltered.values() for x in xs]
    expected = HOSTS * WATCHERS_PER_HOST * VERSIONS
    latest_rate = sum(r["calls"] for r in load) / LOAD_SECONDS
    health_rate = sum(r["calls"] for r in ceiling) / LOAD_SECONDS
    res.add("publish-to-visible p50", _percentile(lat, 0.5), unit="ms")
    res.add("publish-to-visible p99", _percentile(lat, 0.99), "<= 50", unit="ms")
    res.add("events delivered / expected", len(lat) / expected, ">= 1")
    res.add("unfiltered watch: p99", _percentile(every, 0.99), unit="ms")
    res.add("unfiltered: delivered / expected",
            len(every) / (HOSTS * WATCHERS_PER_HOST * UNFILTERED_VERSIONS))  # fmt: skip
    res.add("latest calls/s (2 replicas)", latest_rate, unit="/s")
    res.add("latest / empty-RPC ceiling", latest_rate / health_rate)
    res.details = {
        "watchers": HOSTS * WATCHERS_PER_HOST,
        "versions": VERSIONS,
        "latency_ms_max": max(lat) if lat else None,
        # where the tail comes from: each version's fastest, median and slowest watcher
        "latency_ms_by_version": {
            v: [round(min(x), 1), round(_percentile(x, 0.5), 1), round(max(x), 1)]
            for v, x in sorted(by_version.items())
        },
        "unfiltered_p50_ms": _percentile(every, 0.5) if every else None,
        "latest_per_s": latest_rate,
        "health_per_s": health_rate,
    }
    res.seconds = time.monotonic() - started
    return res
