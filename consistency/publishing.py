"""The publish transaction around a staged manifest, and its retry loop.

Publish is one etcd transaction that compares `latest`'s mod_revision with the one read, so
two publishers racing for the same version cannot both win, and `latest` only ever moves up.
The transaction creates the version's header (or a shard's record) and the publisher's
holder record, and commits the manifest's pages (`consistency.manifests`); a shard's
transaction nests the one that moves `latest`. A lost race re-reads `latest` and tries again;
a transaction that needed more than one attempt may already have been applied, so a failed
compare after it is checked for our own write. `consistency.versions.VersionRegistry`
validates a publish, stages its manifest, and hands it to `Publisher.publish_staged`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

from consistency import ops
from consistency.etcd import Etcd, TxnResult
from consistency.keys import Keys
from consistency.manifests import ManifestStore, Staged
from consistency.records import HolderRecord
from consistency.retry import CAS_POLICY, LostRace
from tensorhub.errors import (
    DeadlineExceeded,
    OutcomeUnknown,
    SessionExpired,
    StaleVersion,
    TensorHubError,
    Unavailable,
)

DEFAULT_TIMEOUT = 10.0


@dataclass(frozen=True)
class Published:
    """The outcome of a publish: the commit revision, and whether it moved `latest`."""

    version: int
    revision: int
    visible: bool


@dataclass
class Latest:
    """`latest` of one model as read: its value, its mod revision and the read's revision."""

    version: int
    mod_revision: int
    revision: int
    extra: dict[str, int] = field(default_factory=dict)


Admit = Callable[[float], tuple[list[ops.Cmp], list[ops.Op]]]


def _admission(admit: Admit | None, state: Latest, timeout: float) -> tuple[list[Any], list[Any]]:
    """Compares and puts a model-creating publish adds (none once the model has `latest`)."""
    if admit is None or state.mod_revision:
        return [], []
    return admit(timeout)


def _session_expired(session: int) -> SessionExpired:
    """What a publish under a lease that is no live session of the tenant gets (as the hub
    answers a missing session everywhere: another tenant's live lease looks the same)."""
    return SessionExpired(f"session {session:x} has expired or was revoked: open a new one")


def _latest_of(result: TxnResult) -> Latest:
    """`latest` as the failure branch of a publish transaction read it (its first get)."""
    found = result.responses[0].response_range.kvs
    if not found:
        return Latest(0, 0, result.revision)
    return Latest(int(found[0].value), int(found[0].mod_revision), result.revision)


class Charge(Protocol):
    """A budget's charge for one publish transaction (`consistency.usage.TenantBudget`):
    called before each attempt for the compares and puts it adds, then told how the
    attempt ended: the commit revision, or None (failed, or its outcome unknown)."""

    def __call__(self, timeout: float) -> tuple[list[ops.Cmp], list[ops.Op]]: ...

    def settle(self, revision: int | None) -> None: ...


def _unknown(model: str, version: int, exc: Exception) -> OutcomeUnknown:
    return OutcomeUnknown(
        f"publish of {model}@{version} may or may not have happened: {exc}; "
        "check latest() or inspect"
    )


class Publisher:
    """Commits staged publishes of one registry's models; `on_visible(tenant, model)` runs
    after a publish made a version visible (the registry's retention)."""

    def __init__(
        self,
        etcd: Etcd,
        keys: Keys,
        manifests: ManifestStore,
        on_visible: Callable[[str, str], None],
    ) -> None:
        self.etcd = etcd
        self.keys = keys
        self.manifests = manifests
        self._on_visible = on_visible

    def read_latest(self, tenant: str, model: str, timeout: float | None) -> Latest:
        """`latest` of `model` (version 0, mod revision 0 if it has none), linearizably."""
        kv, revision = self.etcd.get(self.keys.latest(tenant, model), timeout=timeout)
        if kv is None:
            return Latest(0, 0, revision)
        return Latest(int(kv.value), kv.mod_revision, revision)

    def publish_staged(
        self,
        tenant: str,
        model: str,
        version: int,
        holder: HolderRecord,
        staged: Staged,
        own_key: str,
        own_value: bytes,
        puts: list[ops.Op],
        last: list[ops.Op],
        deadline: float,
        admit_model: Admit | None,
        agree: Callable[[float], list[ops.Cmp]] | None = None,
        *,
        charge: Charge | None = None,
        serial: AbstractContextManager[object] | None = None,
        session_key: str | None = None,
    ) -> Published:
        """The publish transaction around a staged manifest, in `_publish_loop`.

        It creates `own_key` (the header, or the shard record) and the holder record, with
        `puts`, the pages' commits, and `last` (a shard's nested transaction that moves
        `latest`; without one, `puts` move it), under `agree`'s compares (asked before each
        attempt; they may refuse it). Pages of a publish that definitely failed
        are deleted at once, not left under the session's lease for as long as it lives.

        `session_key` (the publisher's session record) is compared inside the transaction:
        a lease that is not one of the tenant's live sessions fails it, and the failure
        branch says so (`SessionExpired`), with no read before the transaction. The failure
        branch also reads `latest`, so a lost race retries against what it read, and
        `charge` is told how the transaction ended (its cached usage is kept or dropped).
        """
        latest_key = self.keys.latest(tenant, model)
        holder_key = self.keys.holder(tenant, model, version, holder.holder)
        what = (
            f"{model}@{version}"
            if holder.shard is None
            else f"shard {holder.shard} of {model}@{version}"
        )

        owned = [ops.exists(session_key)] if session_key is not None else []
        diagnose = [ops.get(latest_key)]
        if session_key is not None:
            diagnose.append(ops.get(session_key, count_only=True))

        def attempt(state: Latest, remaining: float) -> tuple[bool, int, int, Latest | None]:
            guard, bump = _admission(admit_model, state, remaining)
            if agree is not None:
                guard = [*guard, *agree(remaining)]
            with serial or contextlib.nullcontext():  # the charge's read and its commit
                if charge is not None:
                    charged, put = charge(remaining)
                    guard, bump = [*guard, *charged], [*bump, *put]
                try:
                    result = self.etcd.txn(
                        [
                            ops.mod(latest_key, "==", state.mod_revision),
                            ops.absent(own_key),
                            *owned,
                            *guard,
                            *staged.compares,
                        ],
                        [
                            *bump,
                            ops.put(own_key, own_value),
                            ops.put(holder_key, holder.encode(), lease=holder.session),
                            *puts,
                            *staged.commits,
                            *last,  # last: its response is the nested transaction's
                        ],
                        [*diagnose, *staged.count_op()],
                        timeout=remaining,
                    )
                except BaseException:
                    if charge is not None:
                        charge.settle(None)
                    raise
                if charge is not None:
                    charge.settle(result.revision if result.succeeded else None)
            staged.check_pages(result, what)
            if last:
                moved = result.succeeded and result.responses[-1].response_txn.succeeded
                state.extra["moved"] = int(moved)
            if result.succeeded:
                return True, result.revision, result.attempts, None
            if session_key is not None and not int(result.responses[1].response_range.count):
                raise _session_expired(holder.session)
            return False, result.revision, result.attempts, _latest_of(result)

        try:
            return self._publish_loop(tenant, model, version, holder, attempt, deadline, not last)
        except OutcomeUnknown:
            raise  # the pages may be live now; if not, they go with the lease
        except Exception:
            self.manifests.discard(staged, own_key, own_value, DEFAULT_TIMEOUT / 2)
            raise

    def _publish_loop(
        self,
        tenant: str,
        model: str,
        version: int,
        holder: HolderRecord,
        attempt: Callable[[Latest, float], tuple[bool, int, int, Latest | None]],
        deadline: float,
        moves_latest: bool,
    ) -> Published:
        """Read latest, check staleness, try the transaction; repeat on a lost race.

        A transaction that needed more than one attempt may already have been applied, so a
        failed compare after it is checked for our own write (a retry-safe create).
        """
        timeout = deadline - time.monotonic()
        ambiguous = False
        known: Latest | None = None  # `latest` as a failed attempt's failure branch read it
        holder_key = self.keys.holder(tenant, model, version, holder.holder)

        def once() -> Published:
            nonlocal ambiguous, known
            remaining = deadline - time.monotonic()
            try:
                state = known if known is not None else self.read_latest(tenant, model, remaining)
                known = None
                mine = (
                    self._own_write(holder_key, holder, state, version, remaining)
                    if ambiguous
                    else None
                )
            except (Unavailable, DeadlineExceeded) as exc:
                if ambiguous:
                    raise _unknown(model, version, exc) from exc
                raise  # nothing was sent yet: nothing was written
            if mine is not None:
                return mine
            if state.version >= version:
                raise StaleVersion(
                    f"{model}@{version} is not newer than latest {model}@{state.version}"
                )
            try:
                succeeded, revision, attempts, seen = attempt(state, deadline - time.monotonic())
            except (Unavailable, DeadlineExceeded) as exc:
                # The transaction may have reached etcd before its reply was lost.
                raise _unknown(model, version, exc) from exc
            ambiguous = ambiguous or attempts > 1
            if not succeeded:  # `latest` (or the usage) moved: again, against what was read
                known = seen
                raise LostRace(f"latest of {model} moved during the publish of {version}")
            visible = moves_latest or bool(state.extra.get("moved"))
            if visible:
                self._on_visible(tenant, model)
            return Published(version, revision, visible)

        def exhausted() -> TensorHubError:
            if ambiguous:
                return OutcomeUnknown(
                    f"publish of {model}@{version} outcome unknown at its deadline"
                )
            return DeadlineExceeded(
                f"publish of {model}@{version} did not complete within {timeout:.1f}s"
            )

        return CAS_POLICY.compare_and_set(once, deadline, exhausted)

    def _own_write(
        self, holder_key: str, holder: HolderRecord, state: Latest, version: int, timeout: float
    ) -> Published | None:
        """If an earlier attempt of ours was applied, the Published it produced; else None."""
        kv, _ = self.etcd.get(holder_key, timeout=timeout)
        if kv is None or kv.lease != holder.session:
            return None
        return Published(version, kv.mod_revision, state.version >= version)
