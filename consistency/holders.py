"""The holder registry: who holds which version, under which lease; pins.

A holder record lives under its holder's lease, so a dead holder's records vanish for
everyone when the lease expires. Its create_revision is its fencing token: a state change
compares it inside the transaction, so a holder that lost its lease (and whose record was
recreated by a newer incarnation) cannot overwrite the newer record.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from consistency import ops
from consistency.etcd import Etcd
from consistency.keys import Keys
from consistency.quota import CountedCreate
from consistency.records import HolderRecord, HolderState, PartHeader
from consistency.retry import CAS_POLICY, LostRace
from consistency.versions import VersionRegistry
from tensorhub.errors import (
    DeadlineExceeded,
    InvalidArgument,
    LeaseLost,
    PermissionDenied,
    RetentionViolation,
    SessionExpired,
    VersionNotFound,
    VersionRetired,
)
from tensorhub.names import validate_name

DEFAULT_TIMEOUT = 10.0


def _check_shard(model: str, version: int, shard: int | None, count: int) -> None:
    """A holder names a shard exactly when the version is model-parallel, and in range."""
    if count and shard is None:
        raise InvalidArgument(
            f"{model}@{version} is model-parallel ({count} shards): a holder must name its shard"
        )
    if not count and shard is not None:
        raise InvalidArgument(f"{model}@{version} is not model-parallel: a holder has no shard")
    if shard is not None and shard >= count:
        raise InvalidArgument(f"shard {shard} out of range: {model}@{version} has {count}")


def _not_yours(what: str, model: str, version: int, session: int) -> str:
    return (
        f"{what} of {model}@{version} belongs to another session, not {session:x}: "
        "a session releases only what it registered or pinned"
    )


@dataclass(frozen=True)
class HolderPage:
    """One page of a version's holders (`HolderRegistry.page`), read at `revision`.

    `next_after`: the last holder's name when more follow (pass it as `after` for the next
    page), else empty; `total`: how many holders the version has in all; `published_revision`:
    the create revision of the version's manifest key (a version deleted and published again
    has another)."""

    holders: list[HolderRecord]
    next_after: str
    total: int
    pins: list[str]
    published_revision: int
    revision: int


class HolderRegistry:
    """Holder records and pins for versions of models."""

    def __init__(self, versions: VersionRegistry) -> None:
        self.versions = versions
        self.etcd: Etcd = versions.etcd
        self.keys: Keys = versions.keys

    # -- holders ---------------------------------------------------------------------------

    def register(
        self,
        tenant: str,
        model: str,
        version: int,
        record: HolderRecord,
        *,
        timeout: float | None = None,
        session_key: str | None = None,
        header: tuple[int, int] | None = None,
    ) -> int:
        """Register (or re-register) a holder under its lease; returns its fencing token.

        Fails with `VersionNotFound` if the version is not published: no holder record can
        outlive or precede its version's manifest. A holder of a model-parallel version must
        name the one shard it holds (`record.shard`), and a holder of a whole version must not.
        A PARTIAL record also pins the version (`pin/{holder}`, same lease) until the holder
        turns COMPLETE or is released.

        `session_key` (the tenant's record of the holder's session) is compared in the
        transaction: a lease that is no live session of the tenant fails it
        (`SessionExpired`). `header`, the version's (manifest key create revision, shard
        count) as the caller has it cached, spares the read of the manifest key: the
        transaction compares that create revision, and reads it when it differs.
        """
        if record.session <= 0:
            raise InvalidArgument("a holder record needs its session (lease) id")
        manifest_key = self.keys.manifest(tenant, model, version)
        if header is None:
            manifest, _ = self.etcd.get(manifest_key, timeout=timeout)
            if manifest is None:
                raise VersionNotFound(f"{model}@{version} is not published; cannot hold it")
            header = (manifest.create_revision, PartHeader.decode(manifest.value).shards)
        _check_shard(model, version, record.shard, header[1])
        key = self.keys.holder(tenant, model, version, record.holder)
        writes = [ops.put(key, record.encode(), lease=record.session), ops.get(key)]
        if not record.complete:
            # A PARTIAL record pins its version (same lease, same transaction): retention
            # cannot collect a version while a reader is still filling it, and the reader
            # needs no Pin/Unpin writes of its own. COMPLETE (or release) drops the pin.
            pin = self.keys.pin(tenant, model, version, record.holder)
            writes.append(ops.put(pin, b"", lease=record.session))
        owned = [ops.exists(session_key)] if session_key is not None else []
        diagnose = [ops.get(manifest_key, count_only=True)]
        if session_key is not None:
            diagnose.append(ops.get(session_key, count_only=True))
        result = self.etcd.txn(
            [ops.create(manifest_key, "==", header[0]), *owned], writes, diagnose, timeout=timeout
        )
        if result.succeeded:
            return int(result.responses[1].response_range.kvs[0].create_revision)
        if not int(result.responses[0].response_range.count):
            raise VersionNotFound(f"{model}@{version} is not published; cannot hold it")
        if session_key is not None and not int(result.responses[1].response_range.count):
            raise SessionExpired(
                f"session {record.session:x} has expired or was revoked: open a new one"
            )
        # The version was deleted and published again since `header` was read: read it.
        return self.register(
            tenant, model, version, record, timeout=timeout, session_key=session_key
        )

    def update_state(
        self,
        tenant: str,
        model: str,
        version: int,
        record: HolderRecord,
        fence: int,
        *,
        timeout: float | None = None,
    ) -> None:
        """Change a holder's state (PARTIAL → COMPLETE) if its record is still at `fence`;
        COMPLETE drops the pin its PARTIAL registration took (in the same transaction).

        The shard a record names never changes: an update naming another one is refused.
        A record that is gone because its version is (retention, or the model deleted) is
        `VersionRetired`; one gone with its lease, or re-created by a newer incarnation of
        the holder, is `LeaseLost`. The same transaction reads which it was. The record's
        lease is compared with `record.session`: an update cannot move a record to another
        lease, so the session it stays under is the one its registration checked.
        """
        key = self.keys.holder(tenant, model, version, record.holder)
        if record.complete and self._complete_at_once(
            key, record, fence, tenant, model, version, timeout
        ):
            return
        current, _ = self.etcd.get(key, timeout=timeout)
        if current is not None and current.create_revision == fence:
            held = HolderRecord.decode(current.value).shard
            if held != record.shard:
                raise InvalidArgument(
                    f"holder {record.holder} holds shard {held} of {model}@{version}, "
                    f"not {record.shard}"
                )
        writes = [ops.put(key, record.encode(), lease=record.session)]
        if record.complete:  # the pin a PARTIAL registration took is not needed any more
            writes.append(ops.delete(self.keys.pin(tenant, model, version, record.holder)))
        manifest = ops.get(self.keys.manifest(tenant, model, version), count_only=True)
        result = self.etcd.txn(
            [ops.create(key, "==", fence), ops.lease(key, "==", record.session)],
            writes,
            [manifest],
            timeout=timeout,
        )
        if not result.succeeded:
            if not int(result.responses[0].response_range.count):
                raise VersionRetired(
                    f"{model}@{version} was removed (by retention, or with its model) while "
                    f"holder {record.holder} held it: its record went with it"
                )
            raise LeaseLost(
                f"holder {record.holder} of {model}@{version} lost its record (lease expired?)"
            )

    def _complete_at_once(
        self,
        key: str,
        record: HolderRecord,
        fence: int,
        tenant: str,
        model: str,
        version: int,
        timeout: float | None,
    ) -> bool:
        """PARTIAL -> COMPLETE in one transaction, no read first, when the record is exactly
        the PARTIAL one the holder registered (its value compared in the transaction, so
        its shard cannot have changed): every fetch ends this way. False when it is not so
        (or it is gone): `update_state`'s read-then-write path says what happened."""
        partial = record.with_state(HolderState.PARTIAL).encode()
        pin = self.keys.pin(tenant, model, version, record.holder)
        result = self.etcd.txn(
            [
                ops.create(key, "==", fence),
                ops.lease(key, "==", record.session),
                ops.value(key, "==", partial),
            ],
            [ops.put(key, record.encode(), lease=record.session), ops.delete(pin)],
            timeout=timeout,
        )
        return result.succeeded

    def list(
        self, tenant: str, model: str, version: int, *, timeout: float | None = None
    ) -> tuple[list[HolderRecord], int]:
        """Live holders of a version and the revision of the read."""
        result = self.etcd.range(
            self.keys.holders(tenant, model, version), prefix=True, timeout=timeout
        )
        return [
            HolderRecord.decode(kv.value, kv.create_revision) for kv in result.kvs
        ], result.revision

    def page(
        self,
        tenant: str,
        model: str,
        version: int,
        *,
        after: str = "",
        size: int,
        timeout: float | None = None,
    ) -> HolderPage:
        """One page of a published version's holders, by name: at most `size` of those whose
        name sorts after `after` (empty: from the first), with the count of them all, the
        version's pins and the create revision of its manifest key, read in one read-only
        transaction (one revision). `VersionNotFound` if the version is not published (or
        no longer retained)."""
        holders = self.keys.holders(tenant, model, version)
        pins = self.keys.pins(tenant, model, version)
        result = self.etcd.txn(
            [],
            [
                ops.get(self.keys.manifest(tenant, model, version)),
                ops.page(holders, after, size + 1),  # one more: is there a next page?
                ops.get(holders, prefix=True, count_only=True),
                ops.get(pins, prefix=True, keys_only=True),
            ],
            timeout=timeout,
        )
        top, listed, counted, pinned = (r.response_range for r in result.responses)
        if not top.kvs:
            raise VersionNotFound(f"{model}@{version} is not published (or no longer retained)")
        records = [HolderRecord.decode(kv.value, kv.create_revision) for kv in listed.kvs]
        return HolderPage(
            holders=records[:size],
            next_after=records[size - 1].holder if len(records) > size else "",
            total=int(counted.count),
            pins=[bytes(kv.key).decode().rsplit("/", 1)[1] for kv in pinned.kvs],
            published_revision=int(top.kvs[0].create_revision),
            revision=int(result.revision),
        )

    def release(
        self,
        tenant: str,
        model: str,
        version: int,
        holder: str,
        *,
        force: bool = False,
        session: int | None = None,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> int:
        """Delete a holder's record; never silently drop a retained version's last complete holder.

        The check is fenced: the transaction compares that another complete holder's record
        is unchanged (or that `latest` has not moved), so a concurrent release of that other
        holder cannot make both succeed. Returns the revision of the delete.

        With `session`, only the session that registered the record may release it (forced
        or not): the transaction compares the record's lease, so a record re-registered
        meanwhile by another session is not deleted either (`PermissionDenied`).
        """
        key = self.keys.holder(tenant, model, version, validate_name(holder, "holder"))
        latest_key = self.keys.latest(tenant, model)
        pin = self.keys.pin(tenant, model, version, holder)  # a PARTIAL record's pin
        deadline = time.monotonic() + timeout
        if force:
            done = self._release_forced(key, pin, session, timeout)
            if done is not None:
                return done

        def attempt() -> int:
            remaining = deadline - time.monotonic()
            snapshot = self.etcd.range(
                self.keys.version(tenant, model, version), prefix=True, timeout=remaining
            )
            latest_kv, _ = self.etcd.get(latest_key, timeout=remaining)
            mine = None
            complete = []
            for kv in snapshot.kvs:
                _, kind, name = self.keys.parse_version_key(tenant, model, kv.key.decode())
                if kind == "h":
                    record = HolderRecord.decode(kv.value, kv.create_revision)
                    if name == holder:
                        mine = record
                    elif record.state is HolderState.COMPLETE:
                        complete.append((kv, record.shard))
            if mine is None:
                return snapshot.revision  # nothing to release
            if session is not None and mine.session != session:
                raise PermissionDenied(_not_yours(f"holder {holder}", model, version, session))
            # of a model-parallel version, only holders of the same shard can stand in
            others = [kv for kv, shard in complete if shard == mine.shard]
            compares = []
            if not force and mine.complete and self._is_retained(tenant, model, version, remaining):
                if not others:
                    raise RetentionViolation(
                        f"{holder} is the last complete holder of "
                        f"{'' if mine.shard is None else f'shard {mine.shard} of '}"
                        f"retained {model}@{version}; "
                        "release with force=True, or set a spill target, to drop it"
                    )
                compares.append(ops.mod(others[0].key, "==", others[0].mod_revision))
            compares.append(ops.mod(latest_key, "==", latest_kv.mod_revision if latest_kv else 0))
            compares.append(ops.create(key, "==", mine.revision))
            if session is not None:
                compares.append(ops.lease(key, "==", session))
            result = self.etcd.txn(
                compares, [ops.delete(key), ops.delete(pin)], timeout=deadline - time.monotonic()
            )
            if not result.succeeded:  # the record, `latest` or the other holder moved: re-read
                raise LostRace(f"{key} changed while it was being released")
            return result.revision

        return CAS_POLICY.compare_and_set(
            attempt,
            deadline,
            lambda: DeadlineExceeded(
                f"release of {holder} from {model}@{version} did not settle in time"
            ),
        )

    def _release_forced(
        self, key: str, pin: str, session: int | None, timeout: float
    ) -> int | None:
        """A forced release in one transaction, with no read first: delete the record and
        its pin if the record exists (under `session`'s lease, when one is named). A forced
        release checks no retention, so nothing else needs reading: every in-place update
        (a reader releasing the version it is about to overwrite, and its delta's companion)
        costs one etcd round trip instead of three. None when the compare failed (no such
        record, or another session's): the read-then-write path then says which."""
        compares = [ops.exists(key)]
        if session is not None:
            compares.append(ops.lease(key, "==", session))
        result = self.etcd.txn(compares, [ops.delete(key), ops.delete(pin)], timeout=timeout)
        return int(result.revision) if result.succeeded else None

    def _is_retained(self, tenant: str, model: str, version: int, timeout: float) -> bool:
        return version in self.versions.retained(tenant, model, timeout=timeout)

    # -- pins ------------------------------------------------------------------------------

    def pin(
        self,
        tenant: str,
        model: str,
        version: int,
        pin_id: str,
        session: int,
        *,
        max_pinned: int | None = None,
        timeout: float | None = None,
    ) -> int:
        """Keep a version from being collected while a reader works on it (under its lease).

        With `max_pinned`, a pin that would make more than that many versions of the model
        pinned is refused (`QuotaExceeded`): pins keep versions past retention, so without a
        bound they bypass the tenant's retained-versions quota. Race-free among pins: every
        pin of a version not yet pinned bumps the tenant's `pins` fence (`consistency.quota`).
        Pins that PARTIAL holder records take count, but are not refused.
        """
        manifest = self.keys.manifest(tenant, model, version)
        put = ops.put(self.keys.pin(tenant, model, version, pin_id), b"", lease=session)
        if max_pinned is None:
            result = self.etcd.txn([ops.exists(manifest)], [put], timeout=timeout)
            if not result.succeeded:
                raise VersionNotFound(f"{model}@{version} is not published (or already collected)")
            return result.revision
        quota = CountedCreate(
            self.etcd,
            self.keys.quota_fence(tenant, "pins"),
            max_pinned,
            lambda t: self._pinned_versions(tenant, model, t),
            f"pinned versions of {model}",
        )
        deadline = time.monotonic() + (DEFAULT_TIMEOUT if timeout is None else timeout)

        def attempt() -> int:
            guard, bump = quota.admit(deadline - time.monotonic(), name=str(version))
            result = self.etcd.txn(
                [ops.exists(manifest), *guard], [*bump, put], [ops.get(manifest, count_only=True)],
                timeout=max(deadline - time.monotonic(), 0.01),
            )  # fmt: skip
            if result.succeeded:
                return result.revision
            if not result.responses[0].response_range.count:
                raise VersionNotFound(f"{model}@{version} is not published (or already collected)")
            raise LostRace("another pin moved the tenant's pins fence")  # count again

        return CAS_POLICY.compare_and_set(
            attempt,
            deadline,
            lambda: DeadlineExceeded(f"pinning {model}@{version}: the pin count kept changing"),
        )

    def _pinned_versions(self, tenant: str, model: str, timeout: float) -> set[str]:
        """The versions of a model that have a pin (as strings: `CountedCreate` members)."""
        result = self.etcd.range(
            self.keys.versions(tenant, model), prefix=True, keys_only=True, timeout=timeout
        )
        pinned = set()
        for kv in result.kvs:
            version, kind, _ = self.keys.parse_version_key(tenant, model, kv.key.decode())
            if kind == "pin":
                pinned.add(str(version))
        return pinned

    def unpin(
        self,
        tenant: str,
        model: str,
        version: int,
        pin_id: str,
        *,
        session: int | None = None,
        timeout: float | None = None,
    ) -> int:
        """Drop a pin (a missing one: nothing to do). With `session`, only a pin under that
        session's lease is dropped (compared inside the transaction); another session's pin
        is `PermissionDenied`."""
        key = self.keys.pin(tenant, model, version, pin_id)
        if session is None:
            return self.etcd.delete(key, timeout=timeout)
        result = self.etcd.txn(
            [ops.lease(key, "==", session)], [ops.delete(key)], [ops.get(key, count_only=True)],
            timeout=timeout,
        )  # fmt: skip
        if not result.succeeded and result.responses[0].response_range.count:
            raise PermissionDenied(_not_yours(f"pin {pin_id}", model, version, session))
        return result.revision
