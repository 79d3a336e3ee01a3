"""Declared rollout layouts and the publisher's checksums of their block sets
(docs/design-notes.md, "Publish-time checksums of declared layouts").

A rollout declares its layout for a model before the trainer publishes (`Hub.declare_layout`):
per worker, its blocks (name, dtype, global shape, offsets, shape of each). All of a model's
declarations are one key, `{tenant}/lb/{model}/declared` (beside its versions' layout keys,
so `DeleteModel` deletes it with them), changed only by a compare on its mod revision, so the
bounds hold exactly under races: at most `MAX_DECLARED_LAYOUTS` layouts a model (past it:
`TooManyDeclaredLayouts`), `MAX_DECLARED_BLOCK_SETS` block sets a layout, and
`MAX_DECLARED_BYTES` in all. `RetireLayout` deletes one layout from it.

A whole publish carries the mod revision of the declarations its publisher read and, per
declared block set, the wsum64 of every chunk of the block set's layout (`LayoutSums`). Its
transaction compares that revision (a declaration or retirement since: `LayoutsChanged`,
nothing written) and writes one key per declared layout,
`{tenant}/lb/{model}/{version:020d}/{layout}/p`, with the sums of its block sets: the
version and its publisher checksums appear in one commit, and retention deletes them with
it. A reader of a block set reads its sums from that key (`decode_publisher_sums`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from consistency import ops
from consistency.etcd import Etcd
from consistency.keys import Keys
from consistency.retry import CAS_POLICY, LostRace
from tensorhub.declared_records import (
    MAX_DECLARED_BLOCK_SETS,
    MAX_DECLARED_BYTES,
    MAX_DECLARED_LAYOUTS,
    Declared,
    check_rows,
    decode_declared,
    encode_declared,
    encode_publisher_sums,
)
from tensorhub.errors import (
    DeadlineExceeded,
    InvalidArgument,
    LayoutsChanged,
    TooManyDeclaredLayouts,
    VersionNotFound,
)
from tensorhub.names import validate_name


class DeclaredLayouts:
    """Declare, retire and read a tenant's models' declared layouts; what a whole publish
    adds to its transaction for them (`publish_ops`)."""

    def __init__(self, etcd: Etcd, keys: Keys) -> None:
        self.etcd = etcd
        self.keys = keys

    def read(self, tenant: str, model: str, *, timeout: float | None = None) -> Declared:
        kv, _ = self.etcd.get(self.keys.declared_layouts(tenant, model), timeout=timeout)
        if kv is None:
            return Declared({}, 0)
        return Declared(decode_declared(bytes(kv.value)), int(kv.mod_revision))

    def declare(
        self,
        tenant: str,
        model: str,
        layout: str,
        block_sets: Sequence[bytes],
        *,
        timeout: float = 10.0,
    ) -> int:
        """Declare (or replace) `layout` of `model` with `block_sets` (each `check_rows`'),
        the model existing; the commit revision. `TooManyDeclaredLayouts` past
        `MAX_DECLARED_LAYOUTS`, `InvalidArgument` past the other bounds, `VersionNotFound`
        for a model never published."""
        validate_name(layout, "layout")
        if not block_sets:
            raise InvalidArgument("a declared layout names at least one block set")
        unique = sorted(set(block_sets))
        if len(unique) > MAX_DECLARED_BLOCK_SETS:
            raise InvalidArgument(
                f"{len(unique)} block sets in layout {layout!r}: at most {MAX_DECLARED_BLOCK_SETS}"
            )
        for rows in unique:
            check_rows(rows)

        def change(layouts: dict[str, list[bytes]]) -> dict[str, list[bytes]]:
            if layout not in layouts and len(layouts) >= MAX_DECLARED_LAYOUTS:
                raise TooManyDeclaredLayouts(
                    f"{model} has {MAX_DECLARED_LAYOUTS} declared layouts "
                    f"({', '.join(sorted(layouts))}): retire one before declaring {layout!r}"
                )
            return {**layouts, layout: unique}

        return self._change(tenant, model, change, timeout)

    def retire(self, tenant: str, model: str, layout: str, *, timeout: float = 10.0) -> int:
        """Retire `layout` of `model` (versions published from now on carry no checksums
        for it; those already published keep theirs); the commit revision, 0 if it was not
        declared."""
        validate_name(layout, "layout")
        found = self.read(tenant, model, timeout=timeout)
        if layout not in found.layouts:
            return 0
        return self._change(
            tenant, model, lambda ls: {k: v for k, v in ls.items() if k != layout}, timeout
        )

    def _change(
        self,
        tenant: str,
        model: str,
        change: Callable[[dict[str, list[bytes]]], dict[str, list[bytes]]],
        timeout: float,
    ) -> int:
        key = self.keys.declared_layouts(tenant, model)
        latest = self.keys.latest(tenant, model)
        deadline = CAS_POLICY.deadline(timeout)

        def attempt() -> int:
            read = self.etcd.txn(
                [], [ops.get(key), ops.get(latest, count_only=True)], timeout=timeout
            )
            if not int(read.responses[1].response_range.count):
                raise VersionNotFound(f"model {model!r} has no version: publish it first")
            kvs = read.responses[0].response_range.kvs
            seen = int(kvs[0].mod_revision) if kvs else 0
            now = change(decode_declared(bytes(kvs[0].value)) if kvs else {})
            value = encode_declared(now)
            if len(value) > MAX_DECLARED_BYTES:
                raise InvalidArgument(
                    f"{model}'s declared layouts would take {len(value)} bytes: at most "
                    f"{MAX_DECLARED_BYTES}"
                )
            write = ops.put(key, value) if now else ops.delete(key)
            result = self.etcd.txn([ops.mod(key, "==", seen)], [write], timeout=timeout)
            if not result.succeeded:
                raise LostRace(f"{model}'s declared layouts changed meanwhile")
            return int(result.revision)

        return CAS_POLICY.compare_and_set(
            attempt,
            deadline,
            lambda: DeadlineExceeded(f"{model}'s declared layouts kept changing"),
        )

    def publish_ops(
        self,
        tenant: str,
        model: str,
        version: int,
        seen: int,
        sums: Mapping[str, Mapping[str, Sequence[int]]],
        *,
        timeout: float | None = None,
    ) -> tuple[Callable[[float], list[ops.Cmp]], list[ops.Op]]:
        """What a whole publish adds to its transaction: a compare of the declarations' mod
        revision with `seen` (the one the publisher computed `sums` for: per layout, per
        block set, its chunks' wsum64), asked before each attempt, and one put per layout
        of `sums`. The first attempt only compares; a later one (the compare may have
        failed it) reads the key first and refuses with `LayoutsChanged` if it moved."""
        key = self.keys.declared_layouts(tenant, model)
        puts = [
            ops.put(self.keys.publisher_sums(tenant, model, version, layout),
                    encode_publisher_sums(sets))
            for layout, sets in sorted(sums.items())
        ]  # fmt: skip
        tries = [0]

        def agree(remaining: float) -> list[ops.Cmp]:
            tries[0] += 1
            if tries[0] > 1:
                kv, _ = self.etcd.get(key, timeout=remaining)
                now = int(kv.mod_revision) if kv is not None else 0
                if now != seen:
                    raise LayoutsChanged(
                        f"{model}'s declared layouts changed (revision {now}, the publisher "
                        f"read {seen}): read them again and publish again"
                    )
            return [ops.mod(key, "==", seen)]

        return agree, puts
