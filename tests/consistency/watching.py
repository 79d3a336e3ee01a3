"""Watching in tests: waiting until a version is visible in etcd (watched from a revision, never
polled), and a model's events as the hub's fan-out reads them (`WatchedModel`)."""

from __future__ import annotations

import time

from consistency.etcd import Etcd
from consistency.events import WatchEvent
from consistency.keys import Keys
from consistency.watch import KeyWatch, ModelEvents, RawEvent, Resync
from tensorhub.errors import DeadlineExceeded


def wait_for_version(
    etcd: Etcd, keys: Keys, tenant: str, model: str, version: int, *, timeout: float
) -> int:
    """Block until `latest` of the model is at least `version`; returns the revision it was seen at.

    Reads once, then watches `latest` from the revision after that read — waiting is watching,
    never polling. Raises `DeadlineExceeded` at the deadline.
    """
    deadline = time.monotonic() + timeout
    kv, revision = etcd.get(keys.latest(tenant, model), timeout=timeout)
    if kv is not None and int(kv.value) >= version:
        return kv.mod_revision
    with KeyWatch(etcd, keys.latest(tenant, model), prefix=False, start_revision=revision + 1) as w:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DeadlineExceeded(f"{model}@{version} not visible within {timeout:.1f}s")
            event = w.get(remaining)
            if isinstance(event, Resync):
                current = [int(k.value) for k in event.kvs]
                if current and current[0] >= version:
                    return event.revision
            elif (
                isinstance(event, RawEvent) and not event.deleted and int(event.kv.value) >= version
            ):
                return event.revision


class WatchedModel:
    """A model's events read as the hub's fan-out reads them: the model's prefix watched over
    a `WatchMux` (through `KeyWatch`), each etcd item translated by `ModelEvents`."""

    def __init__(
        self, etcd: Etcd, keys: Keys, tenant: str, model: str, *, start_revision: int
    ) -> None:
        self.events = ModelEvents(keys, tenant, model)
        self.raw = KeyWatch(etcd, self.events.prefix, prefix=True, start_revision=start_revision)
        self._pending: list[WatchEvent] = []

    def get(self, timeout: float) -> WatchEvent | None:
        """The next model event, or None if none arrives within `timeout`."""
        deadline = time.monotonic() + timeout
        while not self._pending:
            item = self.raw.get(max(deadline - time.monotonic(), 0.0))
            if item is None:
                return None
            if isinstance(item, RawEvent | Resync):
                self._pending.extend(self.events.translate(item))
        return self._pending.pop(0)

    def close(self) -> None:
        self.raw.close()

    def __enter__(self) -> WatchedModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
