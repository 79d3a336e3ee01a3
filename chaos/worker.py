"""One client process of a chaos run (started as `python -m chaos.roles SPEC_JSON`).

Roles: `publisher` (a trainer: publishes new versions, each a small change of its last,
with `delta=True`), `reader` (a rollout worker: fetches the latest version in place, into
the memory of its last fetch or double-buffered, applying deltas (`chaos.deltas`), and
serves it),
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
import random
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import xxhash

import ros
from chaos.deltas import Weights, delta_record
from chaos.history import FAIL, INFO, OK, Recorder, error_name, write_outcome
from chaos.holder_faults import Fault
from chaos.planted import hooks_for
from consistency.events import EventKind
from tensorhub.errors import InvalidArgument, StaleVersion, TensorHubError

MODEL = "policy"
CHUNK = 64 * 1024
SHAPES = {"w0": 256 * 1024, "w1": 256 * 1024, "w2": 384 * 1024, "bias": 1000}
LATEST_TIMEOUT, FETCH_TIMEOUT, PUBLISH_TIMEOUT, RELEASE_TIMEOUT = 5.0, 20.0, 10.0, 10.0
START_WAIT = 180.0
SCRIBBLE = 0.25  # share of in-place fetches that find a byte of their memory changed


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

    def new_versions(self, model: str = MODEL) -> Iterator[int]:
        """Each version of `model` newer than the last one yielded, as `latest` shows it,
        until the run ends; between polls that show nothing new, a short random pause."""
        done = 0
        while self.running():
            version = self.latest(model)
            if not version or version <= done:
                self.pause(0.1, 0.3)
                continue
            done = version
            yield version


def publisher(w: Worker) -> None:
    """Publish version after version, each a small change of the one before (`Weights`),
    with `delta=True` unless the run says otherwise: each publish after one of this
    process's own is then also published as a delta against it (`chaos.deltas`)."""
    hub = w.connect()
    delta = bool(w.spec.get("delta", True))
    held: list[ros.Publication] = []
    version = (w.latest() or 0) + 1
    weights = Weights(SHAPES, CHUNK, w.rng.randrange(2**31))
    last = 0  # this process's last acknowledged publish: what its next delta encodes against
    while w.running():
        tensors = weights.next()
        op = w.rec.invoke(
            "publish", PUBLISH_TIMEOUT, model=MODEL, version=version, hash=digest(tensors),
            delta=delta,
        )  # fmt: skip
        try:
            pub = hub.publish(
                MODEL, version, tensors, chunk_size=CHUNK, timeout=PUBLISH_TIMEOUT, delta=delta
            )
        except TensorHubError as exc:
            w.rec.complete(op, write_outcome(exc), error_name(exc))
            if isinstance(exc, StaleVersion):
                version = max(version, (w.latest() or 0)) + 1
                # The loser waits longer than the winner (0.2-0.7 s), so one publisher
                # often wins several versions in a row and its deltas chain; were it
                # quicker, the two would take turns, and no delta would lead from the
                # version a reader holds (each encodes against its own last).
                w.pause(0.3, 0.9)
            else:
                version += 1  # it may have landed: never reuse the number
                w.pause(0.1, 0.4)
            continue
        base = last if pub.companion is not None else 0
        w.rec.complete(op, OK, version=version, revision=pub.revision, delta_base=base)
        held.append(pub)
        last = version
        version += 1
        while len(held) > 2:
            release(w, held.pop(0))
        w.pause(0.2, 0.7)


def release(w: Worker, handle: ros.Publication | ros.Held) -> bool:
    """Release `handle` (its delta companion with it); whether its memory is free now."""
    shard = {} if handle.shard is None else {"shard": handle.shard}
    op = w.rec.invoke(
        "release", RELEASE_TIMEOUT, model=handle.model, version=handle.version, **shard
    )
    try:
        handle.release(force=True, timeout=RELEASE_TIMEOUT)
    except TensorHubError as exc:
        w.rec.complete(op, INFO, error_name(exc))
        return handle.released  # the version is let go even if its companion's release failed
    w.rec.complete(op, OK)
    return True


def reader(w: Worker) -> None:
    """Follow `latest` and fetch each newer version, in the spec's read mode
    (`chaos.deltas.READ_MODES`): into the memory of the previous fetch, or double-buffered
    naming the version the spare buffer holds, or double-buffered reading whole."""
    hub = w.connect()
    mode = str(w.spec.get("read_mode", "double"))
    delta = bool(w.spec.get("delta", True)) and mode != "double"
    buffers = [allocate()] if mode == "in-place" else [allocate(), allocate()]
    holds: list[ros.Held | None] = [None] * len(buffers)  # what each buffer serves now
    bases = [0] * len(buffers)  # the version each buffer last held completely
    current: ros.Held | None = None  # the version this reader serves (one of `holds`)
    spare = 0
    while w.running():
        version = w.latest()
        if not version or (current is not None and current.version >= version):
            w.pause(0.1, 0.3)
            continue
        into = spare if len(buffers) == 2 else 0
        previous = holds[into]
        if previous is not None:  # in place: let the version go before writing over it
            if not release(w, previous):
                w.pause(0.1, 0.3)  # still served from this memory: try again later
                continue
            holds[into] = None
            if previous is current:
                current = None
        base = bases[into] if mode == "double-base" and 0 < bases[into] < version else None
        args: dict[str, Any] = {"mode": mode, **({"base": base} if base else {})}
        if mode == "in-place" and delta and bases[into] and w.rng.random() < SCRIBBLE:
            args["scribbled"] = scribble(buffers[into], w.rng)
        op = w.rec.invoke("fetch", FETCH_TIMEOUT, model=MODEL, version=version, **args)
        try:
            got = hub.fetch(
                MODEL, version, into=buffers[into], timeout=FETCH_TIMEOUT, base=base, delta=delta
            )
        except TensorHubError as exc:
            # The buffer is partly overwritten now; `bases` still names what it held: a
            # delta fetch into it must find the chunks that are not that version's.
            w.rec.complete(op, FAIL, error_name(exc))
            w.pause(0.1, 0.3)
            continue
        w.rec.complete(
            op, OK, version=got.version, hash=digest(got.tensors), **delta_record(got.delta)
        )
        holds[into], bases[into] = got, got.version
        if len(buffers) == 2 and current is not None:
            other = 1 - into
            if release(w, current):
                holds[other] = None
        current, spare = got, 1 - into


def scribble(tensors: dict[str, torch.Tensor], rng: random.Random) -> str:
    """Flip one byte of memory this reader no longer serves (as its engine may, once the
    version is released): a delta fetch into it must find that chunk is not the base's."""
    name = rng.choice(sorted(tensors))
    at = rng.randrange(tensors[name].numel())
    tensors[name][at] ^= 0xFF
    return f"{name}[{at}]"


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
