"""Quotas without a check-then-create race.

Counting keys and then creating one is two steps: two creates that both count `limit - 1`
both pass, and the tenant ends one over its quota. Here every counted create also bumps a
per-tenant fence key, and its transaction compares the fence's mod_revision with the one
read *before* the count. A create that committed after that read bumped the fence, so the
later transaction fails and counts again; one that committed before it is in the count.
Deletions (an expired session) do not bump the fence: they can only make a count too high,
never too low, so a quota is never exceeded.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from consistency import ops
from consistency.etcd import Etcd
from tensorhub.errors import InvalidArgument, QuotaExceeded


class CountedCreate:
    """Admission of creates counted against `limit`, guarded by the key `fence`.

    `members(timeout)` lists what counts (model names), or only says how many there are
    (an int: sessions, where a count read sends no keys, whatever their number).
    """

    def __init__(
        self,
        etcd: Etcd,
        fence: str,
        limit: int,
        members: Callable[[float], Collection[str] | int],
        what: str,
    ) -> None:
        self._etcd = etcd
        self._fence = fence
        self._limit = limit
        self._members = members
        self._what = what

    def admit(self, timeout: float, name: str | None = None) -> tuple[list[ops.Cmp], list[ops.Op]]:
        """The compares and puts to add to the creating transaction, or `QuotaExceeded` if
        the quota is full. Nothing to add if `name` already counts (nothing new is created).
        Call again (a fresh count) after the transaction fails."""
        kv, _ = self._etcd.get(self._fence, timeout=timeout)
        seen = kv.mod_revision if kv is not None else 0
        members = self._members(timeout)  # read after the fence: anything newer bumps it
        if isinstance(members, int):
            if name is not None:
                raise InvalidArgument("a create by name needs the members by name, not a count")
            count = members
        elif name is not None and name in members:
            return [], []
        else:
            count = len(members)
        if count >= self._limit:
            raise QuotaExceeded(f"{count} {self._what} (quota {self._limit})")
        return [ops.mod(self._fence, "==", seen)], [ops.put(self._fence, b"")]

    def admit_names(
        self, timeout: float, names: Collection[str]
    ) -> tuple[list[ops.Cmp], list[ops.Op]]:
        """`admit` for several named creates in one transaction (a version's view models):
        nothing to add if every name counts already, else `QuotaExceeded` unless all the
        new ones fit. One fence read and one count, whatever the number of names."""
        kv, _ = self._etcd.get(self._fence, timeout=timeout)
        seen = kv.mod_revision if kv is not None else 0
        members = self._members(timeout)  # read after the fence: anything newer bumps it
        if isinstance(members, int):
            raise InvalidArgument("a create by name needs the members by name, not a count")
        new = len(set(names) - set(members))
        if not new:
            return [], []
        if len(members) + new > self._limit:
            raise QuotaExceeded(f"{len(members)} {self._what} and {new} more (quota {self._limit})")
        return [ops.mod(self._fence, "==", seen)], [ops.put(self._fence, b"")]

    def admit_many(
        self, wanted: int, timeout: float
    ) -> tuple[int, list[ops.Cmp], list[ops.Op], QuotaExceeded | None]:
        """`admit` for `wanted` unnamed creates in one transaction (a batch of sessions):
        how many fit, the compare and put to add for those, and the refusal for the rest
        (None if all fit). One fence read and one count, whatever `wanted` is."""
        kv, _ = self._etcd.get(self._fence, timeout=timeout)
        seen = kv.mod_revision if kv is not None else 0
        members = self._members(timeout)
        count = members if isinstance(members, int) else len(members)
        admitted = max(0, min(wanted, self._limit - count))
        refusal = None
        if admitted < wanted:
            refusal = QuotaExceeded(f"{count + admitted} {self._what} (quota {self._limit})")
        if not admitted:
            return 0, [], [], refusal
        return admitted, [ops.mod(self._fence, "==", seen)], [ops.put(self._fence, b"")], refusal
