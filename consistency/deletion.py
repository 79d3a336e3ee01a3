"""Deleting a whole model: every key of it, in one transaction (`tensorhub delete MODEL`).

A model can get stuck (a version at the top of the version range, a record nobody can read)
or simply be abandoned; the only way out is to remove it. One transaction deletes both of a
model's prefixes (`consistency.keys`): `m/{model}/` (`latest`, every version's manifest
header, shard, holder and pin records) and `mp/{model}/` (manifest pages and the shard
counters), so no reader ever sees half a model, and afterwards the model is as if it had
never been published: it no longer counts against the tenant's models quota (which counts
the models that have keys under `m/`), and it can be published again from version 1.

A model's views (`{model}.{fmt}` and their delta companions, `tensorhub.view_rules`) are
its versions' other forms: the same transaction deletes them, so no view outlives its model
and a model published again does not find the old model's views under its new versions.

Holders that still serve a deleted version keep their memory until they release it; their
records are gone, so no reader is sent to them.
"""

from __future__ import annotations

from dataclasses import dataclass

from etcd3 import etcdrpc

from consistency import ops, usage
from consistency.etcd import Etcd, TxnResult
from consistency.keys import Keys
from consistency.retry import USAGE_RACES, LostRace
from tensorhub.delta_rules import companion_of, is_companion
from tensorhub.errors import InvalidName, Unavailable, VersionNotFound
from tensorhub.names import validate_name
from tensorhub.view_rules import views_of


@dataclass(frozen=True)
class Deleted:
    """What a model deletion removed: at `revision`, `versions` published versions (those
    with a manifest header) and `keys` keys in all."""

    revision: int
    versions: int
    keys: int


def _companion(model: str) -> list[str]:
    """The delta companion of `model` (none for a companion itself, or where the
    companion's name would be too long to have been published)."""
    if is_companion(model):
        return []
    try:
        return [validate_name(companion_of(model))]
    except InvalidName:
        return []


def delete_model(
    etcd: Etcd, keys: Keys, tenant: str, model: str, *, timeout: float | None = None
) -> Deleted:
    """Delete every key of `model` of `tenant`, of its delta companion and of its views
    (with theirs), in one transaction; `VersionNotFound` if none of them has a key at all
    (nothing was deleted). A companion or a view without its model serves no one."""
    models = [model, *_companion(model), *views_of(model)]
    versions = keys.versions(tenant, model)
    listing = etcdrpc.RangeRequest(
        key=ops.b(versions), range_end=ops.prefix_end(versions), keys_only=True
    )
    retried = False

    def attempt() -> TxnResult:
        nonlocal retried
        # The same transaction gives the model's bytes back to the tenant's etcd budget
        # (`consistency.usage`); a publish that changed the budget meanwhile: read again.
        guard, put = usage.release_models(etcd, keys, tenant, models, timeout or 5.0)
        result = etcd.txn(
            guard,
            [
                etcdrpc.RequestOp(request_range=listing),  # read first: the txn's own snapshot
                *(
                    ops.delete(prefix, prefix=True)
                    for name in models
                    for prefix in (
                        keys.model(tenant, name),
                        keys.model_pages(tenant, name),
                        keys.model_layouts(tenant, name),
                    )
                ),
                *put,
            ],
            timeout=timeout,
        )  # a retried delete deletes nothing more: idempotent
        retried = retried or result.attempts > 1
        if not result.succeeded:
            raise LostRace(f"the usage of tenant {tenant} changed during the delete")
        return result

    result = USAGE_RACES.compare_and_set(
        attempt,
        None,  # each call has its own timeout; the races are bounded by count
        lambda: Unavailable(f"deleting model {model}: the tenant's etcd usage kept changing"),
    )
    listed, *deletes = result.responses[: 1 + 3 * len(models)]
    count = sum(  # the keys under `m/` and `mp/` of each (layout block sets: not counted)
        int(response.response_delete_range.deleted)
        for i, response in enumerate(deletes)
        if i % 3 != 2
    )
    if not count and not retried:  # (after a retry: an earlier attempt did it)
        raise VersionNotFound(f"model {model} has nothing to delete: it was never published")
    base = len(ops.b(versions))
    published = sum(  # `{version:020d}/manifest`, not a holder named "manifest"
        bytes(kv.key)[base:].count(b"/") == 1 and bytes(kv.key).endswith(b"/manifest")
        for kv in listed.response_range.kvs
    )
    return Deleted(result.revision, published, count)
