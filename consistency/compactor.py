"""Bounded etcd history: one elected hub replica compacts, defragments and disarms NOSPACE.

Every TensorHub write adds revisions (a trainer with 8 readers adds about 43 a step), and
etcd keeps all of them until someone compacts; the database then grows until etcd raises
its NOSPACE alarm and refuses every write. `Compactor` keeps history bounded:

- **One compactor.** The hub replicas elect one through a create-if-absent key
  (`Keys.hub_compactor`) under the replica's lease. A replica whose lease is lost stops
  compacting; once its key has expired another replica takes over. The election only saves
  work: compaction and defragment are safe to run twice, so a stale leader does no harm.
- **Safe revision, a sliding window.** At every check (`poll`, a fraction of `interval`) the
  leader notes the current revision, and compacts to the newest revision it noted at least
  one interval earlier. A watch that lags less than one interval never meets a compacted
  revision; an older one re-lists (a watch's `Resync`) and resumes. Kept history is always
  between one interval and one interval plus one poll, so the database stays flat instead of
  swinging between one and two intervals of history.
- **Defragment when it pays.** Compaction frees pages inside etcd's file; only a defragment
  gives them back (and etcd's quota counts the file). After a compaction the leader
  defragments each member whose free space passes the thresholds, one member at a time so a
  quorum keeps serving.
- **Recovery without an operator.** While NOSPACE is raised the leader compacts at once (to
  the current revision if it has no older mark), defragments every member it can reach, and
  disarms the alarm once space was freed. A lease cannot be granted under NOSPACE, so when no
  replica holds the role any replica that sees the alarm does this rescue itself.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from consistency import ops
from consistency.etcd import Etcd, MemberStatus
from consistency.keys import Keys
from consistency.session import Session
from tensorhub.errors import (
    InvalidArgument,
    LeaseNotFound,
    RevisionCompacted,
    StorageFull,
    TensorHubError,
)

log = logging.getLogger(__name__)

DEFAULT_INTERVAL = 300.0
DEFAULT_POLL = 5.0  # how often roles and alarms are checked, at most
POLLS_PER_INTERVAL = 10  # checks (and window steps) per interval, unless that is above
DEFAULT_DEFRAG_FREE_BYTES = 16 << 20
DEFAULT_DEFRAG_FREE_RATIO = 0.25
# etcd < 3.4 does not report the in-use size, so free space is unknown: defragment after
# this many compactions instead (and always under NOSPACE).
_BLIND_DEFRAG_EVERY = 12


@dataclass(frozen=True)
class CompactorStatus:
    """A snapshot of one replica's compactor.

    `db_size` / `db_size_in_use` are the largest over the members last seen (the quota is per
    member, so the fullest one matters); `db_size_in_use` is None when etcd does not report it.
    `storage_full` is True while etcd's NOSPACE alarm is raised. Counters are this replica's.
    """

    enabled: bool
    leader: bool
    compacted_revision: int
    db_size: int
    db_size_in_use: int | None
    storage_full: bool
    compactions: int
    defrags: int
    disarms: int
    errors: int
    last_error: str
    members: tuple[MemberStatus, ...] = field(default=())


class Compactor:
    """Keeps etcd's history and database bounded; run one per hub replica, one of them leads.

    `etcd`, `keys`: the replica's client and key schema. `interval`: seconds between
    compactions (0 turns the compactor off; `start()` then does nothing). `session`: the
    replica's own lease to hold the role under; without one the compactor grants its own
    (`ttl` seconds) and revokes it on `stop()`. `name`: what the role key says (default
    host:pid). `poll`: seconds between checks of the role and the alarms. A member is
    defragmented after a compaction when its free space is at least `defrag_free_bytes` and
    at least `defrag_free_ratio` of its file. `on_storage_full(flag)` is called when the
    NOSPACE state changes; `on_tick(status)` after every check (metrics,
    `ros.metrics.CompactorMetrics`). Both run on the compactor's thread and must neither
    block nor raise.
    """

    def __init__(
        self,
        etcd: Etcd,
        keys: Keys,
        *,
        interval: float = DEFAULT_INTERVAL,
        session: Session | None = None,
        ttl: int = 10,
        name: str | None = None,
        poll: float | None = None,
        defrag_free_bytes: int = DEFAULT_DEFRAG_FREE_BYTES,
        defrag_free_ratio: float = DEFAULT_DEFRAG_FREE_RATIO,
        defrag_timeout: float = 60.0,
        on_storage_full: Callable[[bool], None] | None = None,
        on_tick: Callable[[CompactorStatus], None] | None = None,
    ) -> None:
        if interval < 0:
            raise InvalidArgument(f"compaction interval must be >= 0 seconds, got {interval}")
        self._etcd = etcd
        self._key = keys.hub_compactor()
        self.interval = interval
        self.poll = min(interval / POLLS_PER_INTERVAL, DEFAULT_POLL) if poll is None else poll
        self._given_session = session
        self._session: Session | None = session
        self._ttl = ttl
        self.name = name or f"{socket.gethostname()}:{os.getpid()}"
        self._defrag_free_bytes = defrag_free_bytes
        self._defrag_free_ratio = defrag_free_ratio
        self._defrag_timeout = defrag_timeout
        self._on_storage_full = on_storage_full
        self._on_tick = on_tick
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        # Loop state (the compactor thread's own).
        self._role_revision = 0  # create revision of our role key while we hold it
        # (when, revision) noted at each check of this term, oldest first (a sliding window)
        self._marks: deque[tuple[float, int]] = deque()
        self._compactions_since_defrag = 0
        # Reported state (under _lock).
        self._leader = False
        self._compacted = 0
        self._storage_full = False
        self._members: tuple[MemberStatus, ...] = ()
        self._counts = {"compactions": 0, "defrags": 0, "disarms": 0, "errors": 0}
        self._last_error = ""

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> Compactor:
        """Start the background thread (no-op when `interval` is 0 or it already runs)."""
        if self.interval > 0 and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="compactor", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the thread (bounded join) and give the role up so another replica takes it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout)
        self._resign()

    def __enter__(self) -> Compactor:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def status(self) -> CompactorStatus:
        """What this replica knows now (cheap; no etcd call)."""
        with self._lock:
            sizes = [m.db_size for m in self._members]
            in_use = [m.db_size_in_use for m in self._members if m.db_size_in_use is not None]
            return CompactorStatus(
                enabled=self.interval > 0,
                leader=self._leader,
                compacted_revision=self._compacted,
                db_size=max(sizes, default=0),
                db_size_in_use=max(in_use) if in_use else None,
                storage_full=self._storage_full,
                compactions=self._counts["compactions"],
                defrags=self._counts["defrags"],
                disarms=self._counts["disarms"],
                errors=self._counts["errors"],
                last_error=self._last_error,
                members=self._members,
            )

    # -- the loop --------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except TensorHubError as exc:
                log.warning("compactor: %s", exc)
                with self._lock:
                    self._counts["errors"] += 1
                    self._last_error = f"{type(exc).__name__}: {exc}"
            if self._on_tick is not None:
                self._on_tick(self.status())
            self._stop.wait(self.poll)

    def tick(self) -> None:
        """One check: hold or seek the role, watch the alarm, and compact / defrag when due.

        The background thread calls this every `poll` seconds; a compactor that was not
        started may be driven by calling it directly.
        """
        full = any(a.kind == "NOSPACE" for a in self._etcd.alarms())
        self._set_storage_full(full)
        leader, revision = self._campaign(storage_full=full)
        with self._lock:
            self._leader = leader
        if not leader and not (full and revision == 0):
            self._marks.clear()  # a later term starts its own one-interval lag
            return
        # The leader, or (revision 0 under NOSPACE) the rescuer when nobody can hold the role.
        revision = revision or self._etcd.get(self._key)[1]
        now = time.monotonic()
        if full:
            target = self._marks[0][1] if self._marks else revision
            self._compact(target)
            self._disarm(self._defragment_all(force=True))
            self._marks.clear()
            self._marks.append((now, revision))
            return
        self._marks.append((now, revision))
        # Drop marks older than the newest one that is at least one interval old: that one is
        # the safe revision now.
        while len(self._marks) > 1 and now - self._marks[1][0] >= self.interval:
            self._marks.popleft()
        when, safe = self._marks[0]
        if now - when >= self.interval and self._compact(safe):
            self._defragment_all(force=False)
        else:
            self._refresh_members()

    # -- the role --------------------------------------------------------------------------

    def _campaign(self, *, storage_full: bool) -> tuple[bool, int]:
        """(whether we hold the role, a current revision); revision 0: nobody can hold it.

        Reads first, so that under NOSPACE (which refuses every transaction that writes) a
        leader keeps its role; creates the key only when it is absent.
        """
        session = self._live_session(storage_full)
        kv, revision = self._etcd.get(self._key)
        if kv is not None:
            mine = session is not None and kv.lease == session.id
            self._role_revision = kv.create_revision if mine else 0
            return mine, revision
        if session is None:
            return False, 0 if storage_full else revision
        try:
            result = self._etcd.txn(
                [ops.absent(self._key)],
                [ops.put(self._key, self.name, lease=session.id)],
                [ops.get(self._key)],
            )
        except StorageFull:
            return False, 0
        except LeaseNotFound:
            return False, revision  # the replica's lease expired: it cannot hold the role
        if result.succeeded:
            self._role_revision = result.revision
            log.info("compactor: %s holds the role (revision %d)", self.name, result.revision)
            return True, result.revision
        kvs = result.responses[0].response_range.kvs
        mine = bool(kvs) and int(kvs[0].lease) == session.id  # a retried create of our own
        self._role_revision = int(kvs[0].create_revision) if mine else 0
        return mine, result.revision

    def _live_session(self, storage_full: bool) -> Session | None:
        """The lease to hold the role under; our own is re-granted when lost (not under NOSPACE)."""
        if self._session is not None and self._session.alive:
            return self._session
        if self._given_session is not None or storage_full:
            return None  # a lost replica lease is the hub's to replace; none can be granted now
        self._session = Session(self._etcd, ttl=self._ttl)
        return self._session

    def _resign(self) -> None:
        """Delete our role key (only if it is still ours), or revoke our own lease."""
        with self._lock:
            self._leader = False
        if self._session is None:
            return
        if self._session is not self._given_session:
            self._session.close(timeout=2.0)
        elif self._role_revision:
            with contextlib.suppress(TensorHubError):
                self._etcd.txn(
                    [ops.create(self._key, "==", self._role_revision)],
                    [ops.delete(self._key)],
                    timeout=2.0,
                )
        self._role_revision = 0

    # -- the work --------------------------------------------------------------------------

    def _compact(self, target: int) -> bool:
        """Compact history up to `target`; False if it was already compacted that far."""
        with self._lock:
            if target <= self._compacted:
                return False
        # RevisionCompacted: someone (a rescuer, etcd's own auto-compaction) got there first.
        with contextlib.suppress(RevisionCompacted):
            self._etcd.compact(target, timeout=30.0)
        log.info("compactor: compacted etcd history up to revision %d", target)
        with self._lock:
            self._compacted = target
            self._counts["compactions"] += 1
        self._compactions_since_defrag += 1
        return True

    def _refresh_members(self) -> list[MemberStatus]:
        """Status of every member this client can reach (one that cannot answer is skipped)."""
        found: list[MemberStatus] = []
        for endpoint in self._etcd.endpoints:
            try:
                found.append(self._etcd.member_status(endpoint, timeout=2.0))
            except TensorHubError as exc:
                log.info("compactor: no status from %s (%s)", endpoint, exc)
        with self._lock:
            self._members = tuple(found)
        return found

    def _pays(self, member: MemberStatus) -> bool:
        if member.db_size_in_use is None:
            return self._compactions_since_defrag >= _BLIND_DEFRAG_EVERY
        free = member.db_size - member.db_size_in_use
        return free >= self._defrag_free_bytes and free >= self._defrag_free_ratio * member.db_size

    def _defragment_all(self, *, force: bool) -> dict[int, int]:
        """Defragment, one at a time, every member where it pays (all of them if `force`).

        Returns each member's file size from before, by member id (for `_disarm`).
        """
        before = self._refresh_members()
        for member in before:
            if self._stop.is_set() and not force:
                break
            if not (force or self._pays(member)):
                continue
            try:
                self._etcd.defragment(member.endpoint, timeout=self._defrag_timeout)
            except TensorHubError as exc:  # one member down must not keep the others full
                log.warning("compactor: defragment of %s failed (%s)", member.endpoint, exc)
                with self._lock:
                    self._counts["errors"] += 1
                    self._last_error = f"{type(exc).__name__}: {exc}"
                continue
            log.info("compactor: defragmented %s", member.endpoint)
            with self._lock:
                self._counts["defrags"] += 1
        if any(force or self._pays(m) for m in before):
            self._compactions_since_defrag = 0
        self._refresh_members()
        return {m.member_id: m.db_size for m in before}

    def _disarm(self, before: dict[int, int]) -> None:
        """Deactivate NOSPACE alarms once a defragment shrank the alarmed member's file.

        An alarm of a member this client does not reach is disarmed when any member shrank:
        if that one is still full, etcd raises the alarm again on its next write.
        """
        with self._lock:
            after = {m.member_id: m.db_size for m in self._members}
        shrank = {mid for mid, size in after.items() if mid in before and size < before[mid]}
        for alarm in self._etcd.alarms():
            if alarm.kind != "NOSPACE":
                continue
            known = alarm.member_id in after
            if (known and alarm.member_id in shrank) or (not known and shrank):
                self._etcd.disarm(alarm)
                log.warning("compactor: disarmed NOSPACE on member %x", alarm.member_id)
                with self._lock:
                    self._counts["disarms"] += 1
        self._set_storage_full(any(a.kind == "NOSPACE" for a in self._etcd.alarms()))

    def note_storage_full(self) -> None:
        """A write was just refused with NOSPACE: report it at once (`on_storage_full`),
        not at the next check; the next check reads the alarms again and reports when it
        is cleared, whoever cleared it."""
        self._set_storage_full(True)

    def _set_storage_full(self, full: bool) -> None:
        with self._lock:
            changed, self._storage_full = full != self._storage_full, full
        if changed:
            if full:
                log.error("etcd raised NOSPACE: writes are refused until space is freed")
            else:
                log.warning("etcd NOSPACE cleared: writes are accepted again")
            if self._on_storage_full is not None:
                self._on_storage_full(full)
