"""One client process of a chaos run: `python -m chaos.worker SPEC_JSON`.

Roles: `publisher` (a trainer: publishes new versions with random content), `reader` (a
rollout worker: fetches the latest version in place, double-buffered, and serves it),
`watcher` (watches new versions), `poller` (calls `latest` in a loop), `intruder` (the
other tenant, see `chaos.intruder`), and the model-parallel workload's `rank` and
`shard-reader` (`chaos.shards`). Every call goes into the history (`chaos.history`)
with its deadline; content is hashed on both sides so the checker can compare bytes.

The process waits for the run's start file (which holds the run's end time), works until
then, and exits. Its client is built with the hooks of its spec's planted bug, if any
(chaos.planted), and its holder sends through a `Fault` (chaos.holder_faults) that
SIGUSR1/SIGUSR2 switch to corrupt bytes and back (the `corrupt-holder` failpoint); SIGTERM
ends it after the current operation.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import xxhash

import ros
from chaos.history import FAIL, INFO, OK, Recorder, error_name, write_outcome
from chaos.holder_faults import Fault
from chaos.planted import hooks_for
from consistency.watch import EventKind
from tensorhub.errors import InvalidArgument, StaleVersion, TensorHubError

MODEL = "policy"
CHUNK = 64 * 1024
SHAPES = {"w0": 256 * 1024, "w1": 256 * 1024, "w2": 384 * 1024, "bias": 1000}
LATEST_TIMEOUT, FETCH_TIMEOUT, PUBLISH_TIMEOUT, RELEASE_TIMEOUT = 5.0, 20.0, 10.0, 10.0
START_WAIT = 180.0


def digest(tensors: dict[str, torch.Tensor]) -> str:
    """Content hash of a version: names and bytes, in name order."""
    h = xxhash.xxh3_128()
    for name in sorted(tensors):
        h.update(name.encode() + b"\0")
        h.update(tensors[name].contiguous().numpy().tobytes())
    return h.hexdigest()


def allocate() -> dict[str, torch.Tensor]:
    return {name: torch.zeros(n, dtype=torch.uint8) for name, n in SHAPES.items()}


class Worker:
    """Shared plumbing: the spec, the history, the end time, the hub connection."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.name = f"{spec['name']}#{spec['gen']}"
        self.rng = random.Random(f"{spec['seed']}/{self.name}")
        self.rec = Recorder(Path(spec["history"]), self.name)
        self.stopping = threading.Event()
        self.hub: ros.Hub | None = None
        self.fault = Fault()  # the corrupt-holder failpoint's switch (its holder sends via it)
        self.hooks = hooks_for(spec.get("planted", ""), send=self.fault)
        _faults(self)  # before saying ready: a signal must never find the default handler
        ready = Path(spec["history"]).with_suffix(".ready")
        ready.write_text(str(spec["gen"]))  # this incarnation is ready to start
        self.end = _wait_start(Path(spec["start_file"]))

    def running(self) -> bool:
        return not self.stopping.is_set() and time.monotonic() < self.end

    def connect(self) -> ros.Hub:
        """Connect (bounded, retried until the end: the hub may be down at start-up)."""
        spec = self.spec
        while True:
            try:
                self.hub = ros.connect(
                    spec["hubs"], tenant=spec["tenant"], token=spec["token"],
                    listen=spec.get("listen", "127.0.0.1:0"), advertise=spec.get("advertise"),
                    name=f"{spec['name']}-g{spec['gen']}-{self.rng.randrange(16**4):04x}",
                    timeout=LATEST_TIMEOUT, session_ttl=int(spec.get("session_ttl", 5)),
                    hooks=self.hooks,
                )  # fmt: skip
                return self.hub
            except TensorHubError as exc:
                if not self.running():
                    raise
                print(f"{self.name}: connect failed ({exc}); retrying", file=sys.stderr)
                time.sleep(0.5)

    def call(self, f: str, timeout: float, fn: Callable[[], dict[str, Any]], **args: Any) -> Any:
        """Run one read-like operation with history: any error is a definite `fail`."""
        op = self.rec.invoke(f, timeout, **args)
        try:
            value = fn()
        except TensorHubError as exc:
            self.rec.complete(op, FAIL, error_name(exc))
            return None
        self.rec.complete(op, OK, **value)
        return value

    @property
    def client(self) -> ros.Hub:
        if self.hub is None:
            raise InvalidArgument("the worker is not connected yet")
        return self.hub

    def latest(self, model: str = MODEL) -> int | None:
        hub = self.client

        def read() -> dict[str, Any]:
            version = hub.latest(model, timeout=LATEST_TIMEOUT)
            # One operation at a time per process: the floor is this answer's revision.
            return {"version": version, "revision": hub.floor.value}

        value = self.call("latest", LATEST_TIMEOUT, read, model=model)
        return None if value is None else int(value["version"])

    def pause(self, low: float, high: float) -> None:
        self.stopping.wait(self.rng.uniform(low, high))


def publisher(w: Worker) -> None:
    hub = w.connect()
    held: list[ros.Publication] = []
    version = (w.latest() or 0) + 1
    gen = torch.Generator().manual_seed(w.rng.randrange(2**31))
    while w.running():
        tensors = {
            name: torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
            for name, n in SHAPES.items()
        }
        op = w.rec.invoke(
            "publish", PUBLISH_TIMEOUT, model=MODEL, version=version, hash=digest(tensors)
        )
        try:
            pub = hub.publish(MODEL, version, tensors, chunk_size=CHUNK, timeout=PUBLISH_TIMEOUT)
        except TensorHubError as exc:
            w.rec.complete(op, write_outcome(exc), error_name(exc))
            if isinstance(exc, StaleVersion):
                version = max(version, (w.latest() or 0)) + 1
            else:
                version += 1  # it may have landed: never reuse the number
            w.pause(0.1, 0.4)
            continue
        w.rec.complete(op, OK, version=version, revision=pub.revision)
        held.append(pub)
        version += 1
        while len(held) > 2:
            release(w, held.pop(0))
        w.pause(0.2, 0.7)


def release(w: Worker, handle: ros.Publication | ros.Held) -> None:
    shard = {} if handle.shard is None else {"shard": handle.shard}
    op = w.rec.invoke(
        "release", RELEASE_TIMEOUT, model=handle.model, version=handle.version, **shard
    )
    try:
        handle.release(force=True, timeout=RELEASE_TIMEOUT)
    except TensorHubError as exc:
        w.rec.complete(op, INFO, error_name(exc))
        return
    w.rec.complete(op, OK)


def reader(w: Worker) -> None:
    hub = w.connect()
    buffers = [allocate(), allocate()]
    held: ros.Held | None = None
    spare = 0
    while w.running():
        version = w.latest()
        if not version or (held is not None and held.version >= version):
            w.pause(0.1, 0.3)
            continue
        into = buffers[spare]
        op = w.rec.invoke("fetch", FETCH_TIMEOUT, model=MODEL, version=version)
        try:
            got = hub.fetch(MODEL, version, into=into, timeout=FETCH_TIMEOUT)
        except TensorHubError as exc:
            w.rec.complete(op, FAIL, error_name(exc))
            w.pause(0.1, 0.3)
            continue
        w.rec.complete(op, OK, version=got.version, hash=digest(got.tensors))
        if held is not None:
            release(w, held)
        held, spare = got, 1 - spare


def watcher(w: Worker) -> None:
    """Follow the model's versions from one start revision to the end of the run.

    A broken stream is reopened where it left off (`since`), so the history claims
    continuous coverage: the checker requires every acknowledged publish from the first
    open's revision to the last event to have been seen. Odd-numbered watchers ask for
    `versions_only`, so the hub's filter is exercised under the same faults.
    """
    hub = w.connect()
    versions_only = int(w.spec["name"].rsplit("-", 1)[-1]) % 2 == 1
    since: int | None = None
    while w.running():
        try:
            watch = hub.watch(MODEL, since=since, versions_only=versions_only)
        except TensorHubError as exc:
            w.rec.instant("watch-error", error=error_name(exc))
            w.pause(0.2, 0.5)
            continue
        if since is None:
            since = watch.next_revision
        w.rec.instant("watch-open", since=since, versions_only=versions_only)
        with watch:
            while w.running():
                try:
                    event = watch.get(min(1.0, max(0.0, w.end - time.monotonic())))
                except TensorHubError as exc:
                    w.rec.instant("watch-error", error=error_name(exc))
                    break
                if event is None:
                    continue
                since = event.revision + 1
                if event.kind is EventKind.VERSION_PUBLISHED:
                    w.rec.instant("watch", version=event.version, revision=event.revision)
                elif event.kind is EventKind.RESYNC:
                    w.rec.instant("watch-resync", version=event.version, revision=event.revision)
                elif versions_only:
                    w.rec.instant("watch-unwanted", kind=event.kind.name, revision=event.revision)


def poller(w: Worker) -> None:
    w.connect()
    while w.running():
        w.latest()
        w.pause(0.03, 0.08)


def _wait_start(path: Path) -> float:
    """The run's end time, from its start file (bounded wait for the file to appear)."""
    deadline = time.monotonic() + START_WAIT
    while time.monotonic() < deadline:
        try:
            return float(json.loads(path.read_text())["end"])
        except (OSError, ValueError, KeyError):
            time.sleep(0.05)
    return time.monotonic()  # no start: end at once


def _faults(w: Worker) -> None:
    """SIGUSR1: this holder starts returning corrupted chunk bytes; SIGUSR2: it stops."""

    def set_corrupt(on: bool) -> None:
        w.fault.corrupt = on

    signal.signal(signal.SIGUSR1, lambda *_: set_corrupt(True))
    signal.signal(signal.SIGUSR2, lambda *_: set_corrupt(False))
    signal.signal(signal.SIGTERM, lambda *_: w.stopping.set())


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    w = Worker(spec)
    roles: dict[str, Callable[[Worker], None]] = {
        "publisher": publisher, "reader": reader, "watcher": watcher, "poller": poller,
    }  # fmt: skip
    if spec["role"] == "intruder":
        from chaos.intruder import intruder

        roles["intruder"] = intruder
    if spec["role"] in ("rank", "shard-reader"):
        from chaos.shards import rank, shard_reader

        roles.update({"rank": rank, "shard-reader": shard_reader})
    try:
        roles[spec["role"]](w)
    except TensorHubError as exc:  # e.g. the hub never came back before the end
        print(f"{w.name}: {error_name(exc)}", file=sys.stderr)
    finally:
        if w.hub is not None:
            w.hub.close()
        w.rec.close()
    return 0


def _exit(code: int) -> None:
    """Leave at once, without the interpreter's finalization: its last garbage collection
    over torch's objects costs a second or two of CPU per process, which a run's 18 or more
    workers ending together on two cores turned into 10-15 s between the run's end and its
    check. Everything worth keeping is written by then (the history is flushed per line and
    closed, the hub connection closed)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit(main(sys.argv[1:]))
