"""Tenant records and the replicas' shared secret in etcd: every request the hub's tenant
store (`ros.hub.tenants.TenantStore`) makes, and the decoding of what it reads.

A tenant's record is a JSON object (its token hash, epoch and quotas) under
`Keys.tenant_record`; the create revision of that key fences every write made on the
tenant's behalf (`fence`). Deleting a tenant removes its record and everything under its
prefix in one transaction, which also lists its sessions' leases so they can be revoked.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from consistency import ops
from consistency.etcd import Etcd, Fence
from consistency.keys import Keys
from consistency.watch import KeyWatch, RawEvent, Resync
from tensorhub.errors import PermissionDenied

_READ_SECONDS = 10.0  # deadline of one read of a record, or of the records' revision


@dataclass(frozen=True)
class Deleted:
    """A tenant deleted: the revision of the delete, and the leases of the sessions it had
    (to revoke: `TenantRecords.revoke`)."""

    revision: int
    leases: list[int]


class TenantRecords:
    """Tenant records in etcd, read and written for the hub's tenant store."""

    def __init__(self, etcd: Etcd, keys: Keys) -> None:
        self._etcd = etcd
        self._keys = keys

    def check_name(self, name: str) -> None:
        """`InvalidArgument` if `name` cannot name a tenant record."""
        self._keys.tenant_record(name)

    def create(self, name: str, record: dict[str, Any]) -> bool:
        """Write `record` as tenant `name`'s if it has none (False: it exists)."""
        key = self._keys.tenant_record(name)
        result = self._etcd.txn([ops.absent(key)], [ops.put(key, json.dumps(record))])
        return bool(result.succeeded)

    def read(self, name: str) -> dict[str, Any] | None:
        """Tenant `name`'s record (None: there is none), with `created`: the create revision
        of its key, what its writes are fenced on."""
        kv, _ = self._etcd.get(self._keys.tenant_record(name), timeout=_READ_SECONDS)
        if kv is None:
            return None
        record: dict[str, Any] = json.loads(kv.value)
        record["created"] = kv.create_revision
        return record

    def quotas(self, timeout: float) -> list[dict[str, Any]]:
        """Every tenant's quotas, as their records hold them (one range read)."""
        listed = self._etcd.range(self._keys.tenants(), prefix=True, timeout=timeout)
        return [dict(json.loads(kv.value).get("quotas", {})) for kv in listed.kvs]

    def secret(self, candidate: bytes) -> bytes:
        """The replicas' shared secret: `candidate` if none was stored yet (it is now),
        else the stored one (one create-if-absent transaction)."""
        key = self._keys.hub_secret()
        result = self._etcd.txn([ops.absent(key)], [ops.put(key, candidate)], [ops.get(key)])
        if result.succeeded:
            return candidate
        return bytes(result.responses[0].response_range.kvs[0].value)

    def fence(self, name: str, created: int, refusal: Callable[[], PermissionDenied]) -> Fence:
        """What a write for tenant `name` compares: its record's create revision is still
        `created` (else `refusal()` is raised)."""
        return Fence(self._keys.tenant_record(name), created, refusal)

    def delete(self, name: str, timeout: float) -> Deleted | None:
        """Delete tenant `name`'s record and everything under its prefix (models, versions,
        holders, pins, session marks, quota fences) in one transaction, which lists the
        session marks first (None: there is no such tenant)."""
        record = self._keys.tenant_record(name)
        result = self._etcd.txn(
            [ops.exists(record)],
            [
                ops.get(self._keys.sessions(name), prefix=True),  # first: the state before
                ops.delete(record),
                ops.delete(self._keys.tenant(name), prefix=True),
            ],
            timeout=timeout,
        )
        if not result.succeeded:
            return None
        kvs = result.responses[0].response_range.kvs  # bounded by the session quota
        return Deleted(result.revision, [int(kv.lease) for kv in kvs])

    def revoke(self, leases: list[int], timeout: float) -> None:
        """Revoke the leases of a deleted tenant's sessions."""
        for lease in leases:
            self._etcd.lease_revoke(lease, timeout=timeout)

    def follow(
        self, stop: threading.Event, changed: Callable[[str], None], resync: Callable[[], None]
    ) -> None:
        """One watch of the tenant records, from the present, until `stop` or a failure:
        `resync()` first and at every gap in the watch, `changed(name)` for each change to
        a tenant's record."""
        base = self._keys.tenants()
        _, revision = self._etcd.get(base, timeout=_READ_SECONDS)
        resync()  # whatever changed before this watch began
        with contextlib.closing(
            KeyWatch(self._etcd, base, prefix=True, start_revision=revision + 1)
        ) as watch:
            while not stop.is_set():
                item = watch.get(0.5)
                if isinstance(item, RawEvent):
                    changed(item.kv.key.decode()[len(base) :])
                elif isinstance(item, Resync):
                    resync()
