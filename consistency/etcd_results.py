"""What the etcd client's calls answer, as values: a range's keys at their revision
(`RangeResult`), a transaction's outcome and its attempts (`TxnResult`), a member's
maintenance status (`MemberStatus`) and an active alarm (`Alarm`).

Apart from the client (`consistency.etcd`, which names them in its `__all__`) because they
are plain data, read by the callers of its calls; nothing here talks to etcd.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from consistency.ops import KV


@dataclass(frozen=True)
class MemberStatus:
    """One member's maintenance status: who it is, who leads, and how big its database is.

    `db_size` is the backend file's size (what etcd's quota counts); `db_size_in_use` is the
    part holding live pages (the rest is freed by a defragment). etcd reports the latter from
    3.4 on; it is None when the member does not. `errors` lists the member's active alarms
    as etcd words them (3.4+; empty before).
    """

    endpoint: str
    member_id: int
    leader: int
    version: str
    db_size: int
    db_size_in_use: int | None
    raft_index: int
    errors: tuple[str, ...] = ()


@dataclass(frozen=True)
class Alarm:
    """An active cluster alarm: the member that raised it and its type (`NOSPACE`, `CORRUPT`)."""

    member_id: int
    kind: str


@dataclass(frozen=True)
class RangeResult:
    """The keys a range read found, and the store revision it was served at."""

    kvs: list[KV]
    revision: int


@dataclass(frozen=True)
class TxnResult:
    """Whether a transaction's compares held, its revision, and how many attempts it took.

    `attempts > 1` means an earlier attempt may have been applied before its reply was lost,
    so a failed compare can be the caller's own write: callers check ownership then.
    """

    succeeded: bool
    revision: int
    responses: list[Any]
    attempts: int
