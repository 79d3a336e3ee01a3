"""The compares and puts every batch of a version's shards shares: `latest` and the
counter unchanged since read, the model quota's fence while the model is new, the tenant's
budget charged for the batch's shards (`Budget`), the counter's new value, and, in the batch
that completes the version, `latest` and the headers of the version and its views.

`consistency.shard_commit` adds each shard's own compares and puts to these. Apart from it
because this is where a batch meets the quotas: which shards the budget refuses and how
the batch that makes the version visible is told from the others, decided on the state the
batch read (`consistency.shard_state.BatchRead`) with no etcd call but the model quota's.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Protocol

from consistency import ops
from consistency.keys import Keys
from consistency.publishing import Admit
from consistency.records import PartHeader
from consistency.shard_entries import Outcome, ShardEntry
from consistency.shard_state import BatchRead
from tensorhub.errors import QuotaExceeded


class Budget(Protocol):
    """The tenant's budget for a batch (`consistency.usage.TenantBudget`): the key it keeps
    the usage in (read with the batch's opening read, so charging costs no round trip of
    its own), and how many of the batch's `sizes`, in order, fit the usage as read, with
    the compare and put that charge them and the refusal for the rest. `arrived`: how many
    shards of the version earlier batches committed (the counter as read, compared in the
    batch's transaction), so the batch's shards are its arrivals `arrived`, `arrived` + 1,
    ... (what `consistency.usage.shard_tokens` charges by)."""

    key: str

    def charge(
        self, sizes: Sequence[int], usage: ops.KV | None, arrived: int
    ) -> tuple[int, list[ops.Cmp], list[ops.Op], QuotaExceeded | None]: ...


class ShardGuards:
    """A batch's shared compares and puts (`_guards`), for `ShardCommitter`, which derives
    from it and sets these attributes in its `__init__`."""

    keys: Keys
    tenant: str
    model: str
    version: int
    budget_refused: int
    _latest: str
    _arrived: str
    _admit: Admit | None
    _budget: Budget | None

    def _guards(
        self,
        writing: list[ShardEntry],
        state: BatchRead,
        outcomes: dict[int, Outcome],
        remaining: float,
        carried: bool = False,
    ) -> tuple[list[ops.Cmp], list[ops.Op], bool]:
        """The batch's shared compares and puts: latest, the counter, the model quota, the
        budget (entries past it get `QuotaExceeded`; counted in `budget_refused` unless on
        a `carried` state, which a read decides again), and visibility if this batch
        completes the version."""
        count = state.count or writing[0].count
        compares = [
            ops.mod(self._latest, "==", state.latest_mod),
            ops.mod(self._arrived, "==", state.arrived_mod),
        ]
        puts: list[ops.Op] = []
        new_views = bool(writing[0].views)  # a view model may be new while its model is not
        if (
            self._admit is not None
            and (not state.latest_mod or new_views)
            and not state.arrived_mod
        ):
            # (a counter means an earlier batch counted the model: its shards are keys of it)
            try:
                guard, bump = self._admit(remaining)
            except QuotaExceeded as exc:
                for entry in writing:
                    outcomes[id(entry)] = exc
                return [], [], False
            compares += guard
            puts += bump
        if self._budget is not None:
            admitted, guard, charge, refusal = self._budget.charge(
                [e.size for e in writing], state.usage, state.arrived
            )
            for entry in writing[admitted:]:
                outcomes[id(entry)] = refusal or QuotaExceeded("tenant budget")
            if not carried:
                self.budget_refused += len(writing) - admitted
            compares += guard
            puts += charge
            writing = writing[:admitted]
        arrived = state.arrived + len(writing)
        views = writing[0].view_models if writing else []
        counter: dict[str, object] = {"count": count, "arrived": arrived}
        if views:
            counter["views"] = views
        puts.append(ops.put(self._arrived, json.dumps(counter)))
        visible = arrived == count
        if visible:
            header = PartHeader(0, b"", shards=count).encode()
            puts += [
                ops.put(self._latest, str(self.version)),
                ops.put(self.keys.manifest(self.tenant, self.model, self.version), header),
            ]
            for view in views:  # the views become visible with their version
                at = self.keys.manifest(self.tenant, view, self.version)
                compares.append(ops.absent(at))
                puts += [ops.put(at, header), ops.put(self.keys.latest(self.tenant, view),
                                                      str(self.version))]  # fmt: skip
        return compares, puts, visible
