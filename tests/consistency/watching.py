"""Waiting in a test until a version is visible in etcd: watched from a revision, never polled."""

from __future__ import annotations

import time

from consistency.etcd import Etcd
from consistency.keys import Keys
from consistency.watch import KeyWatch, RawEvent, Resync
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
