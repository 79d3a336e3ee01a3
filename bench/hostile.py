"""`tensorhub bench watches [--names 2000] [--hub-tree PATH] [--json PATH]`: a hostile tenant
watching many distinct model names, and what it costs the hub and another tenant.

What it guards against: one tenant opens a Watch stream on each of 2,000 made-up model names.
A hub that keeps one etcd watch per name starts about three threads per name (1,436 threads,
170 % CPU), the other tenant's `Latest` slows (median 80 ms, max 2.9 s), and after the
attacker cancels the hub answers nothing for about 25 s. One run here, against a fresh etcd
and one hub process (`bench.scale.world.World`, the hub of `--hub-tree` when given, as
`bench scale` does):

1. idle: the hub's threads and CPU, and `--samples` sequential `Latest` calls of the other
   tenant (the victim);
2. attack: an attacker process (`python -m bench.hostile attack`, so its own CPU is not the
   victim's) opens `--names` Watch streams, one per distinct name, from the current revision
   (new shared watches, not replays), plus one more name: refused with `Overloaded` by a hub
   with `--max-watched-models-per-tenant` (set to `--names` when the hub has the flag),
   accepted by an older one. Once the hub serves them (its `tensorhub_hub_watches_active`
   gauge), the same figures are taken again;
3. cancel: the attacker cancels every stream at once; the victim keeps calling `Latest`
   until the hub has let go of every watch (at least `--cancel-seconds`).

The figures are ratios to the idle phase of the same run: hub threads under attack minus
idle (target <= 10) and the victim's `Latest` p99 under attack and while cancelling over its
idle p99 (target <= 2).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import IO, Any

import grpc

from bench.report import Result, emit
from bench.scale.clients import WorkerLost
from bench.scale.load import percentile
from bench.scale.procs import ProcStats, Server, ServerStartError, create_tenant, gauge
from bench.scale.world import World
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from ros.proto.tensorhub.v1 import hub_pb2_grpc

THREADS_TARGET = "<= 10"
P99_TARGET = "<= 2"
CALL_TIMEOUT = 5.0  # seconds: a victim call past it counts as an error (and as 5 s)
ATTACK_CHANNELS = 4  # the attacker spreads its streams over this many connections
OPEN_SECONDS = 180.0  # deadline for the hub to serve every attacker stream
BOUND_FLAG = "--max-watched-models-per-tenant"
WATCHES_GAUGE = "tensorhub_hub_watches_active"


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--names", type=int, default=2000, help="distinct names the attacker watches")
    ap.add_argument(
        "--samples", type=int, default=1000, help="victim Latest calls per phase (default 1000)"
    )
    ap.add_argument(
        "--gap", type=float, default=0.01, help="seconds between the victim's calls (0.01)"
    )
    ap.add_argument(
        "--phase-seconds",
        type=float,
        default=40.0,
        help="a phase's sampling stops here even if calls remain (a slow hub) (default 40)",
    )
    ap.add_argument(
        "--cancel-seconds",
        type=float,
        default=8.0,
        help="the victim keeps calling at least this long after the cancel (default 8)",
    )
    ap.add_argument("--hub-tree", help="run the hub of another checkout (e.g. a worktree)")
    ap.add_argument("--json", metavar="PATH", help="write the figures as JSON (- = stdout)")


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="tensorhub bench watches", description=__doc__)
    add_arguments(ap)
    return ap.parse_args(argv)


# -- the victim ----------------------------------------------------------------------------


@dataclass
class Latencies:
    """The victim's `Latest` calls of one phase: seconds each, and how many failed."""

    seconds: list[float] = field(default_factory=list)
    errors: int = 0

    def ms(self, q: float) -> float | None:
        value = percentile(self.seconds, q)
        return None if value is None else value * 1000

    def summary(self) -> dict[str, Any]:
        return {
            "calls": len(self.seconds),
            "errors": self.errors,
            "p50_ms": self.ms(0.5),
            "p99_ms": self.ms(0.99),
            "max_ms": self.ms(1.0),
        }


class Victim:
    """The other tenant: sequential `Latest` calls on one connection, each timed."""

    def __init__(self, address: str, token: str) -> None:
        self._channel = grpc.insecure_channel(address)
        self._stub = hub_pb2_grpc.TensorHubStub(self._channel)  # type: ignore[no-untyped-call]
        self._metadata = (("authorization", f"Bearer {token}"),)

    def call(self, into: Latencies) -> None:
        started = time.perf_counter()
        try:
            self._stub.Latest(
                pb.LatestRequest(model="policy"), metadata=self._metadata, timeout=CALL_TIMEOUT
            )
        except grpc.RpcError:
            into.errors += 1
        into.seconds.append(time.perf_counter() - started)

    def sample(self, count: int, gap: float, seconds: float) -> Latencies:
        """`count` calls `gap` apart, or as many as fit in `seconds` (a slow hub)."""
        out = Latencies()
        deadline = time.monotonic() + seconds
        for _ in range(count):
            if time.monotonic() >= deadline:
                break
            self.call(out)
            time.sleep(gap)
        return out

    def close(self) -> None:
        self._channel.close()


# -- the attacker (its own process) --------------------------------------------------------


class Attacker:
    """`python -m bench.hostile attack` driven over its stdin/stdout: it opens the streams,
    reports (`{"opened", "refused", "failed"}`), cancels them all on `cancel`. `WorkerLost`
    when it does not report in time."""

    def __init__(self, address: str, token: str, names: int) -> None:
        env = dict(os.environ, THB_ATTACK_TOKEN=token)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.hostile", "attack", address, str(names)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
        )  # fmt: skip
        stdin, stdout = self.proc.stdin, self.proc.stdout
        if stdin is None or stdout is None:  # Popen opens both with PIPE
            self.proc.kill()
            raise WorkerLost("the attacker process was started without its pipes")
        self._stdin: IO[str] = stdin
        self._stdout: IO[str] = stdout

    def _line(self, timeout: float) -> dict[str, Any]:
        """The attacker's next report line (a JSON object), within `timeout` seconds."""
        line = _readline(self._stdout, timeout)
        if not line:
            code = self.proc.poll()
            why = f"ended (exit {code})" if code is not None else f"is silent after {timeout} s"
            raise WorkerLost(f"the attacker {why} without a report")
        report: dict[str, Any] = json.loads(line)
        return report

    def opened(self, timeout: float) -> dict[str, Any]:
        return self._line(timeout)

    def cancel(self) -> None:
        self._stdin.write("cancel\n")
        self._stdin.flush()

    def cancelled(self, timeout: float) -> dict[str, Any]:
        return self._line(timeout)

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self._stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def _readline(stream: IO[str], timeout: float) -> str:
    """One line of `stream`, or '' when none comes within `timeout` (a pipe, so `select`)."""
    ready, _, _ = select.select([stream], [], [], timeout)
    return stream.readline() if ready else ""


async def _attack(address: str, token: str, names: int) -> None:
    """The attacker: `names` + 1 Watch streams on distinct names from the current revision,
    spread over `ATTACK_CHANNELS` connections; reports, then cancels all on `cancel`."""
    metadata = (("authorization", f"Bearer {token}"),)
    channels = [grpc.aio.insecure_channel(address) for _ in range(ATTACK_CHANNELS)]
    stubs = [hub_pb2_grpc.TensorHubStub(c) for c in channels]  # type: ignore[no-untyped-call]
    latest = await stubs[0].Latest(pb.LatestRequest(model="x"), metadata=metadata, timeout=30)
    start = int(latest.revision) + 1
    calls = [
        stubs[i % ATTACK_CHANNELS].Watch(
            pb.WatchRequest(model=f"made-up-{i}", start_revision=start, versions_only=True),
            metadata=metadata,
        )
        for i in range(names + 1)  # the last one is the probe past the bound
    ]
    refused = failed = 0

    async def watch(call: Any) -> None:
        nonlocal refused, failed
        try:
            await call.read()
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                refused += 1
            elif exc.code() != grpc.StatusCode.CANCELLED:
                failed += 1

    tasks = [asyncio.ensure_future(watch(call)) for call in calls]
    await asyncio.sleep(3.0)  # refusals come at once; the rest stay open
    print(json.dumps({"opened": len(calls), "refused": refused, "failed": failed}), flush=True)
    loop = asyncio.get_running_loop()
    command = await loop.run_in_executor(None, sys.stdin.readline)
    started = time.monotonic()
    if command.strip() == "cancel":
        for call in calls:
            call.cancel()
    await asyncio.wait(tasks, timeout=30)
    print(json.dumps({"cancelled_in": time.monotonic() - started}), flush=True)
    await loop.run_in_executor(None, sys.stdin.readline)  # until the bench closes stdin
    for channel in channels:
        await channel.close(None)


# -- the run -------------------------------------------------------------------------------


def hub_has_bound(tree: str | None) -> bool:
    """Whether the hub to run (this checkout's, or `tree`'s) has `BOUND_FLAG`."""
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = tree
    done = subprocess.run(
        [sys.executable, "-m", "ros.cli", "serve", "--help"],
        capture_output=True, text=True, timeout=60, check=False, cwd=tree, env=env,
    )  # fmt: skip
    return BOUND_FLAG in done.stdout


def _wait_gauge(port: int, check: Any, seconds: float) -> float | None:
    """Poll the hub's watches gauge until `check(value)`; its last value (bounded)."""
    deadline = time.monotonic() + seconds
    value = gauge(port, WATCHES_GAUGE)
    while time.monotonic() < deadline and not check(value):
        time.sleep(0.2)
        value = gauge(port, WATCHES_GAUGE)
    return value


def _freed(hub: Server, idle_threads: int) -> bool:
    """Whether the hub has let go of the attacker's watches: no watch stream left (its
    metrics answered) and its threads back within `THREADS_TARGET` of idle."""
    active = gauge(hub.metrics_port, WATCHES_GAUGE)  # None: the hub did not answer
    return active is not None and active <= 0 and hub.stats().threads <= idle_threads + 10


def _cpu_percent(before: ProcStats, after: ProcStats, wall: float) -> float:
    return 100.0 * (after.cpu_s - before.cpu_s) / max(wall, 1e-6)


def run(args: argparse.Namespace) -> Result:
    tree = f" --hub-tree {args.hub_tree}" if args.hub_tree else ""
    result = Result("watches", f"tensorhub bench watches --names {args.names}{tree}")
    started = time.monotonic()
    bounded = hub_has_bound(args.hub_tree)
    flags = [BOUND_FLAG, str(args.names)] if bounded else []
    with World(flags, max_sessions=16, tree=args.hub_tree, metrics=True) as world:
        hub = world.hub
        if hub is None:
            raise ServerStartError("the bench's world started no hub")
        attacker_token = create_tenant(world.address, world.admin, 16)
        victim = Victim(world.address, world.token)
        attacker: Attacker | None = None
        try:
            victim.sample(20, args.gap, args.phase_seconds)  # warm: token cached, workers up
            time.sleep(1.0)
            _log("idle: sampling the victim")
            idle_stats, t0 = hub.stats(), time.monotonic()
            idle = victim.sample(args.samples, args.gap, args.phase_seconds)
            idle_cpu = _cpu_percent(idle_stats, hub.stats(), time.monotonic() - t0)

            _log(f"attack: {args.names} + 1 distinct names")
            attacker = Attacker(world.address, attacker_token, args.names)
            report = attacker.opened(OPEN_SECONDS)
            served = _wait_gauge(
                hub.metrics_port, lambda v: v is not None and v >= args.names, OPEN_SECONDS
            )
            _log(f"attack: the hub serves {served} watch streams; sampling the victim")
            time.sleep(2.0)  # let whatever the hub started per watch settle
            attack_stats, t0 = hub.stats(), time.monotonic()
            attack = victim.sample(args.samples, args.gap, args.phase_seconds)
            after = hub.stats()
            attack_cpu = _cpu_percent(attack_stats, after, time.monotonic() - t0)
            attack_threads = max(attack_stats.threads, after.threads)

            _log("cancel: the attacker cancels every stream")
            attacker.cancel()
            t0 = time.monotonic()
            cancelling = Latencies()
            freed_in: float | None = None
            while time.monotonic() - t0 < 60:
                victim.call(cancelling)
                if freed_in is None and _freed(hub, idle_stats.threads):
                    freed_in = time.monotonic() - t0
                if freed_in is not None and time.monotonic() - t0 >= args.cancel_seconds:
                    break
                time.sleep(args.gap)
            attacker.cancelled(30)
            time.sleep(2.0)
            settled = hub.stats()
        finally:
            victim.close()
            if attacker is not None:
                attacker.stop()

    idle_p99, attack_p99, cancel_p99 = idle.ms(0.99), attack.ms(0.99), cancelling.ms(0.99)
    result.add("hub threads: attack - idle", attack_threads - idle_stats.threads, THREADS_TARGET)
    result.add("victim Latest p99: attack / idle", _ratio(attack_p99, idle_p99), P99_TARGET)
    result.add("victim Latest p99: cancelling / idle", _ratio(cancel_p99, idle_p99), P99_TARGET)
    result.add("hub threads idle", idle_stats.threads, unit="threads")
    result.add("hub threads under attack", attack_threads, unit="threads")
    result.add("hub CPU idle", idle_cpu, unit="%")
    result.add("hub CPU under attack", attack_cpu, unit="%")
    for name, phase in (("idle", idle), ("attack", attack), ("cancelling", cancelling)):
        result.add(f"victim Latest p50 {name}", phase.ms(0.5), unit="ms")
        result.add(f"victim Latest p99 {name}", phase.ms(0.99), unit="ms")
        result.add(f"victim Latest max {name}", phase.ms(1.0), unit="ms")
        result.add(f"victim Latest errors {name}", phase.errors, unit="calls")
    result.add("watch streams served", served, unit="streams")
    result.add(f"name {args.names + 1} refused (Overloaded)", report["refused"], unit="streams")
    result.add("watches freed after cancel (streams ended, threads back)", freed_in, unit="s")
    result.details = {
        "names": args.names,
        "hub_tree": args.hub_tree,
        "bound_flag": flags,
        "attacker": report,
        "idle": idle.summary(),
        "attack": attack.summary(),
        "cancelling": cancelling.summary(),
        "threads": {
            "idle": idle_stats.threads,
            "attack": attack_threads,
            "after_cancel": settled.threads,
        },
        "rss_mb": {"idle": idle_stats.rss_mb, "attack": after.rss_mb},
    }
    result.seconds = time.monotonic() - started
    return result


def _log(message: str) -> None:
    print(f"bench watches: {message}", file=sys.stderr, flush=True)


def _terminated(signum: int, frame: object) -> None:
    """SIGTERM (e.g. `timeout`): unwind, so the hub, etcd and the attacker are stopped."""
    raise SystemExit(128 + signum)


def _ratio(value: float | None, base: float | None) -> float | None:
    return None if value is None or not base else value / base


def main(argv: list[str]) -> int:
    if argv[:1] == ["attack"]:
        address, names = argv[1], int(argv[2])
        asyncio.run(_attack(address, os.environ["THB_ATTACK_TOKEN"], names))
        return 0
    signal.signal(signal.SIGTERM, _terminated)
    args = parse(argv)
    out = [run(args)]
    return emit(out, args.json)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
