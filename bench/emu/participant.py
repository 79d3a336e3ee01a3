"""A benchmark participant: one process inside one emulated host's namespace.

Reads JSON commands (`{"op": NAME, ...}`) from stdin and answers each with one JSON line
on stdout (`{"error": ...}` on failure), until stdin closes. The TensorHub commands use the
SDK exactly as a trainer or rollout worker would (`ros.connect` with this host's topology,
its holder server bound to this host's address); `bench.emu.baseline_ops` has the
baselines, and `bench.emu.delta_ops` the commands of delta versions (a trainer that trains
a real model, readers that fetch each version into the memory of the one before).

Run by the harness as `ip netns exec NS python -m bench.emu.participant HOST_IP`.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from grpc_health.v1 import health_pb2, health_pb2_grpc

import ros
from bench.emu import baseline_ops, commands
from bench.emu.delta_ops import DeltaRole
from bench.emu.model import digest, make_model
from bench.emu.reshard_ops import ReadStarts, ReshardRole
from consistency.events import EventKind
from ros.client.handles import Held, Publication
from ros.client.hooks import ClientHooks
from ros.client.watch import HubWatch
from tensorhub.errors import EngineNotReady


class Participant:
    """This process's state: its hub connection and the versions it holds."""

    def __init__(self, ip: str) -> None:
        self.ip = ip
        self.hub: ros.Hub | None = None
        self.pubs: dict[int, Publication] = {}
        self.helds: dict[int, Held] = {}
        self.seen: list[tuple[int, float]] = []
        self.watches: list[HubWatch] = []
        self.lock = threading.Lock()
        self.read_starts = ReadStarts()  # each version's first read round (bench reshard)

    def _hub(self) -> ros.Hub:
        if self.hub is None:
            raise EngineNotReady("this participant has not connected: connect first")
        return self.hub

    def connect(
        self,
        hub: list[str],
        tenant: str,
        token: str,
        topology: dict[str, str],
        transports: list[str] | None = None,
    ) -> Any:
        """`transports`: what the client serves and reads over (`ros.connect`'s, e.g.
        `["nixl"]`; None: its default). UCX's `UCX_*` settings, which NIXL reads when its
        agents are made, are in this process's environment from its start."""
        self.hub = ros.connect(
            hub, tenant=tenant, token=token, topology=topology, listen=f"{self.ip}:0",
            transports=transports, hooks=ClientHooks(
                read=self.read_starts.hook, ranges=self.read_starts.range_hook
            ),
        )  # fmt: skip
        return {"holder": self.hub.holder_name}

    def publish(self, model: str, version: int, nbytes: int, seed: int, chunk: int) -> Any:
        tensors = make_model(nbytes, seed)
        start = time.monotonic()
        pub = self._hub().publish(model, version, tensors, chunk_size=chunk)
        self.pubs[version] = pub
        return {"t0": start, "t1": time.monotonic(), "digest": digest(tensors)}

    def wait(self, version: int, k: int, timeout: float = 120.0) -> Any:
        """Trainer stall: wait until k other holders are complete, then release."""
        start = time.monotonic()
        self.pubs[version].wait_replicated(k, timeout=timeout)
        end = time.monotonic()
        self.pubs.pop(version).release(force=True)
        return {"t0": start, "t1": end}

    def fetch(self, model: str, version: int, timeout: float = 120.0) -> Any:
        start = time.monotonic()
        held = self._hub().fetch(model, version, timeout=timeout)
        end = time.monotonic()
        self.helds[version] = held
        return {
            "t0": start,
            "t1": end,
            "digest": digest(held.tensors),
            "bytes_per_source": held.stats.bytes_per_source,
            "transports": held.stats.transports,  # holder id -> the kind it was read over
            "fallbacks": held.stats.fallbacks,  # holder id -> why not over a better kind
        }

    def release(self, version: int) -> Any:
        for table in (self.pubs, self.helds):
            handle = table.pop(version, None)
            if handle is not None:
                handle.release(force=True)
        return {}

    def watchers(self, model: str, count: int, versions_only: bool = True) -> Any:
        """Open `count` watches of `model` that record when each new version shows up
        (`versions_only`: the filtered watch a rollout uses; else every holder event too)."""
        ready = threading.Barrier(count + 1)
        for _ in range(count):
            watch = self._hub().watch(model, versions_only=versions_only)
            self.watches.append(watch)
            threading.Thread(target=self._watch, args=(watch, ready), daemon=True).start()
        ready.wait(timeout=60)
        return {}

    def _watch(self, events: HubWatch, ready: threading.Barrier) -> None:
        ready.wait(timeout=60)
        for event in events:
            if event.kind is EventKind.VERSION_PUBLISHED:
                with self.lock:
                    self.seen.append((event.version, time.monotonic()))

    def stop_watchers(self) -> Any:
        """Close every watch opened by `watchers` and forget what they saw."""
        for watch in self.watches:
            watch.close()
        with self.lock:
            self.watches, self.seen = [], []
        return {}

    def seen_versions(self) -> Any:
        with self.lock:
            return {"seen": list(self.seen)}

    def rpc_load(self, model: str, threads: int, seconds: float, kind: str) -> Any:
        """Call `latest` (kind "latest") or the gRPC health check on the same channel (the
        ceiling: an RPC that does no work) from `threads` threads for `seconds`."""
        counts = [0] * threads
        end = time.monotonic() + seconds
        health = health_pb2_grpc.HealthStub(self._hub()._channel)
        check = health_pb2.HealthCheckRequest(service="")

        def loop(i: int) -> None:
            while time.monotonic() < end:
                if kind == "latest":
                    self._hub().latest(model)
                else:
                    health.Check(check, timeout=5)
                counts[i] += 1

        workers = [threading.Thread(target=loop, args=(i,)) for i in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        return {"calls": sum(counts), "seconds": seconds}

    def ping(self) -> Any:
        return {"t": time.monotonic()}


def main() -> int:
    me = Participant(sys.argv[1])
    ops: dict[str, Callable[..., Any]] = {
        name: getattr(me, name)
        for name in (
            "connect",
            "publish",
            "wait",
            "fetch",
            "release",
            "watchers",
            "seen_versions",
            "stop_watchers",
            "rpc_load",
            "ping",
        )
    }
    deltas = DeltaRole(me._hub)
    for name in ("train_init", "train_step", "publish_plain", "fetch_into", "drop"):
        ops[name] = getattr(deltas, name)
    reshard = ReshardRole(me._hub, me.read_starts)
    for name in (
        "reshard_setup", "reshard_declare", "shard_publish", "read_blocks", "reshard_release",
    ):  # fmt: skip
        ops[name] = getattr(reshard, name)
    for name in ("plain_listen", "plain_recv", "serve", "tfetch", "gloo"):
        fn = getattr(baseline_ops, name)
        ops[name] = lambda _fn=fn, **kw: _fn(me.ip, **kw)
    commands.serve(ops)
    if me.hub is not None:
        me.hub.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
