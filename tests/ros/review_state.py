"""What etcd holds of one model, read at one revision, and the checks a race must leave true.

Used by the fault tests of issue 25 (`tests/ros/test_review_*.py`): after `DeleteModel`
raced a publish, or a hub replica died in the middle of one, the keys of the model must be
either nothing, or whole visible versions (each with every key a reader needs), or shards of
one version still in flight; and the tenant's usage key must charge exactly what is left.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field

from consistency import Etcd, Keys, ops
from consistency.records import HolderRecord, PartHeader, ShardRecord
from consistency.usage import RECORD_BYTES, Usage, versions_charge
from consistency.versions import VersionRegistry


@dataclass
class ModelState:
    """Every key of one model (`m/{model}/` and `mp/{model}/`), decoded, at `revision`."""

    revision: int
    latest: int | None = None  # None: no `latest` key
    headers: dict[int, PartHeader] = field(default_factory=dict)
    shards: dict[int, dict[int, ShardRecord]] = field(default_factory=lambda: defaultdict(dict))
    holders: dict[int, list[HolderRecord]] = field(default_factory=lambda: defaultdict(list))
    pins: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    counters: dict[int, dict[str, int]] = field(default_factory=dict)
    # (version, part, writer) -> [page keys]; part "whole" or a shard index as written
    pages: dict[tuple[int, str, str], list[str]] = field(default_factory=lambda: defaultdict(list))
    other: list[str] = field(default_factory=list)  # keys of no known shape

    @property
    def empty(self) -> bool:
        """No key of the model at all: as if it had never been published."""
        return (
            self.latest is None
            and not self.headers
            and not self.shards
            and not self.holders
            and not self.pins
            and not self.counters
            and not self.pages
            and not self.other
        )

    def visible(self) -> list[int]:
        """Versions with a header: what a reader can resolve."""
        return sorted(self.headers)


def read_model(etcd: Etcd, keys: Keys, tenant: str, model: str) -> ModelState:
    """Both prefixes of `model` in one read-only transaction (one snapshot)."""
    top, paged = keys.model(tenant, model), keys.model_pages(tenant, model)
    result = etcd.txn([], [ops.get(top, prefix=True), ops.get(paged, prefix=True)])
    state = ModelState(result.revision)
    model_kvs, page_kvs = (r.response_range.kvs for r in result.responses)
    for kv in model_kvs:
        key = bytes(kv.key).decode()
        if key == keys.latest(tenant, model):
            state.latest = int(kv.value)
            continue
        try:
            version, kind, _ = keys.parse_version_key(tenant, model, key)
        except Exception:
            state.other.append(key)
            continue
        if kind == "manifest":
            state.headers[version] = PartHeader.decode(bytes(kv.value))
        elif kind == "shard":
            record = ShardRecord.decode(bytes(kv.value))
            state.shards[version][record.index] = record
        elif kind == "h":
            state.holders[version].append(HolderRecord.decode(bytes(kv.value)))
        elif kind == "pin":
            state.pins[version] += 1
        else:
            state.other.append(key)
    for kv in page_kvs:
        key = bytes(kv.key).decode()
        rest = key[len(paged) :].split("/")
        if len(rest) == 2 and rest[1] == "arrived":
            state.counters[int(rest[0])] = json.loads(bytes(kv.value))
        elif len(rest) == 4:
            state.pages[(int(rest[0]), rest[1], rest[2])].append(key)
        else:
            state.other.append(key)
    return state


def _part(index: int | None) -> str:
    return "whole" if index is None else f"{index:06d}"


def violations(state: ModelState) -> list[str]:
    """What is wrong with `state`, as sentences; empty when it is consistent.

    Consistent means: `latest` names a version with a header, and no header is above it;
    every visible version has every key a reader needs (a whole version's pages; a
    model-parallel version's shard records 0..n-1 and their pages); every shard record,
    holder record, pin, counter and page belongs to a visible version or to the one version
    in flight (shards without a header, their counter equal to the records there); nothing
    of any other shape.
    """
    found: list[str] = []
    if state.other:
        found.append(f"keys of no known shape: {state.other}")
    if state.latest is not None and state.latest not in state.headers:
        found.append(f"latest is {state.latest} but that version has no header")
    if state.headers and state.latest is None:
        found.append(f"headers {state.visible()} with no latest key")
    for version, header in state.headers.items():
        if state.latest is not None and version > state.latest:
            found.append(f"version {version} has a header above latest {state.latest}")
        if header.shards:
            have = set(state.shards.get(version, {}))
            missing = sorted(set(range(header.shards)) - have)
            if missing:
                found.append(f"visible {version} ({header.shards} shards) misses {missing}")
        elif header.pages:
            got = len(state.pages.get((version, "whole", header.writer), []))
            if got != header.pages:
                found.append(f"visible {version} has {got} of its {header.pages} pages")
    for version, records in state.shards.items():
        for index, record in records.items():
            if record.part.pages:
                got = len(state.pages.get((version, _part(index), record.part.writer), []))
                if got != record.part.pages:
                    found.append(
                        f"shard {index} of {version} has {got} of {record.part.pages} pages"
                    )
        if version not in state.headers:
            counter = state.counters.get(version)
            if counter is None or counter.get("arrived") != len(records):
                found.append(
                    f"version {version} in flight: {len(records)} shard records, counter {counter}"
                )
    in_flight = sorted(v for v in state.shards if v not in state.headers)
    if len(in_flight) > 1:
        found.append(f"more than one version in flight: {in_flight}")
    known = set(state.headers) | set(state.shards)
    for what, versions in (
        ("holder records", state.holders),
        ("pins", state.pins),
        ("shard counters", state.counters),
    ):
        orphans = sorted(set(versions) - known)
        if orphans:
            found.append(f"{what} of versions with no header or shard: {orphans}")
    referenced = {
        (v, "whole", h.writer) for v, h in state.headers.items() if h.pages and not h.shards
    } | {
        (v, _part(i), r.part.writer)
        for v, records in state.shards.items()
        for i, r in records.items()
        if r.part.pages
    }
    orphan_pages = sorted(set(state.pages) - referenced)
    if orphan_pages:
        found.append(f"manifest pages nothing refers to: {orphan_pages}")
    return found


def usage_held(etcd: Etcd, keys: Keys, tenant: str) -> int:
    """The bytes the tenant's usage key charges now (0 without one)."""
    kv, _ = etcd.get(keys.quota_fence(tenant, "usage"))
    return Usage.decode(kv.value).held if kv is not None else 0


def model_charge(etcd: Etcd, keys: Keys, tenant: str, model: str, timeout: float | None) -> int:
    """What every version of `model` was charged, as the delete that releases the model
    counts it (`consistency.usage.versions_charge` over one range read of its version keys),
    plus its layout block sets' keys, each its value's length and `RECORD_BYTES`, counted
    from the keys themselves (not from the tallies the hub releases them by)."""
    result = etcd.range(keys.versions(tenant, model), prefix=True, timeout=timeout)
    return versions_charge(keys, tenant, model, result.kvs) + block_sets_charge(
        etcd, keys, tenant, model, timeout
    )


def block_sets_charge(
    etcd: Etcd, keys: Keys, tenant: str, model: str, timeout: float | None
) -> int:
    """The layout block sets' keys of `model` (`lb/{model}/{version}/{layout}/s/{id}`),
    each its value's length plus `RECORD_BYTES`."""
    prefix = keys.model_layouts(tenant, model)
    found = etcd.range(prefix, prefix=True, timeout=timeout)
    return sum(
        len(bytes(kv.value)) + RECORD_BYTES
        for kv in found.kvs
        if bytes(kv.key).decode()[len(prefix) :].split("/")[2:3] == ["s"]
    )


def charged_by_keys(etcd: Etcd, keys: Keys, tenant: str) -> int:
    """What the tenant's keys in etcd say it should be charged: every model's headers and
    shard records, as `consistency.usage` counts them."""
    models = VersionRegistry(etcd, keys).models(tenant)
    return sum(model_charge(etcd, keys, tenant, model, 5.0) for model in models)


def settled(etcd: Etcd, keys: Keys, tenant: str, model: str, *, exact: bool = True) -> ModelState:
    """The model's keys, checked consistent (`violations`), with the tenant's usage equal
    to what its keys were charged (`exact=False`: at least that, never less: a budget that
    charges less than etcd holds would let a tenant past its quota; more is a leak, see
    `test_a_publish_between_the_deletes_two_reads_is_not_left_charged`)."""
    state = read_model(etcd, keys, tenant, model)
    assert not violations(state), violations(state)
    held, charged = usage_held(etcd, keys, tenant), charged_by_keys(etcd, keys, tenant)
    assert held == charged if exact else held >= charged, (held, charged)
    return state
