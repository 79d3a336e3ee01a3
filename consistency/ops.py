"""Typed builders for etcd requests: compares, puts, deletes, ranges and nested transactions.

Thin wrappers over the generated `etcd3.etcdrpc` messages, so the registries read like the
transactions they are (`mod(latest) == seen`, `put(key, value, lease)`), with prefixes
expressed as `range_end` rather than by hand.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from etcd3 import etcdrpc

Op = Any  # an etcdrpc.RequestOp; the generated code carries no type information
Cmp = Any  # an etcdrpc.Compare
CmpOp = Literal["==", "!=", "<", ">"]

_RESULT = {
    "==": etcdrpc.Compare.EQUAL,
    "!=": etcdrpc.Compare.NOT_EQUAL,
    "<": etcdrpc.Compare.LESS,
    ">": etcdrpc.Compare.GREATER,
}


def b(key: str | bytes) -> bytes:
    """Keys and values as bytes (str is encoded as UTF-8)."""
    return key.encode() if isinstance(key, str) else key


def prefix_end(prefix: str | bytes) -> bytes:
    """The `range_end` that makes a range (or compare) cover every key starting with `prefix`."""
    raw = bytearray(b(prefix))
    while raw:
        if raw[-1] < 0xFF:
            raw[-1] += 1
            return bytes(raw)
        raw.pop()
    return b"\0"  # the whole keyspace


@dataclass(frozen=True)
class KV:
    """One key-value with its revisions (`create_revision` is the fencing token)."""

    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int

    @classmethod
    def from_pb(cls, kv: Any) -> KV:
        return cls(
            key=bytes(kv.key),
            value=bytes(kv.value),
            create_revision=int(kv.create_revision),
            mod_revision=int(kv.mod_revision),
            version=int(kv.version),
            lease=int(kv.lease),
        )


def _compare(key: str | bytes, prefix: bool, result: CmpOp) -> Any:
    cmp = etcdrpc.Compare()
    cmp.key = b(key)
    if prefix:
        cmp.range_end = prefix_end(key)
    cmp.result = _RESULT[result]
    return cmp


def mod(key: str | bytes, result: CmpOp, revision: int) -> Cmp:
    """Compare a key's mod_revision (0 when absent)."""
    cmp = _compare(key, False, result)
    cmp.target = etcdrpc.Compare.MOD
    cmp.mod_revision = revision
    return cmp


def create(key: str | bytes, result: CmpOp, revision: int) -> Cmp:
    """Compare a key's create_revision (0 when absent): the ownership/fencing check."""
    cmp = _compare(key, False, result)
    cmp.target = etcdrpc.Compare.CREATE
    cmp.create_revision = revision
    return cmp


def lease(key: str | bytes, result: CmpOp, lease_id: int) -> Cmp:
    """Compare the lease a key is attached to (0 when absent or attached to none)."""
    cmp = _compare(key, False, result)
    cmp.target = etcdrpc.Compare.LEASE
    cmp.lease = lease_id
    return cmp


def absent(key: str | bytes) -> Cmp:
    """True when `key` does not exist."""
    return create(key, "==", 0)


def exists(key: str | bytes) -> Cmp:
    """True when `key` exists."""
    return create(key, ">", 0)


def version(key: str | bytes, result: CmpOp, count: int) -> Cmp:
    """Compare a key's version: how many times it was put since created (0 when absent)."""
    cmp = _compare(key, False, result)
    cmp.target = etcdrpc.Compare.VERSION
    cmp.version = count
    return cmp


def none_under(prefix: str | bytes) -> Cmp:
    """True when no key starts with `prefix` (a range compare on version == 0)."""
    cmp = _compare(prefix, True, "==")
    cmp.target = etcdrpc.Compare.VERSION
    cmp.version = 0
    return cmp


def value(key: str | bytes, result: CmpOp, expected: str | bytes) -> Cmp:
    """Compare a key's value (etcd fails any value compare on an absent key)."""
    cmp = _compare(key, False, result)
    cmp.target = etcdrpc.Compare.VALUE
    cmp.value = b(expected)
    return cmp


def put(
    key: str | bytes, value: str | bytes = b"", lease: int = 0, *, ignore_value: bool = False
) -> Op:
    """Put `value` under `lease` (0: none). `ignore_value` keeps the stored value without
    resending it: the put then only (re)sets the lease, e.g. detaches a key from one with
    lease 0. etcd refuses it for a key that does not exist."""
    request = etcdrpc.PutRequest(key=b(key), lease=lease, ignore_value=ignore_value)
    if not ignore_value:
        request.value = b(value)
    return etcdrpc.RequestOp(request_put=request)


def delete(key: str | bytes, *, prefix: bool = False) -> Op:
    req = etcdrpc.DeleteRangeRequest(key=b(key))
    if prefix:
        req.range_end = prefix_end(key)
    return etcdrpc.RequestOp(request_delete_range=req)


def get(
    key: str | bytes, *, prefix: bool = False, count_only: bool = False, keys_only: bool = False
) -> Op:
    """Read a key or a prefix inside a transaction (`count_only`: just how many keys;
    `keys_only`: the keys without their values)."""
    req = etcdrpc.RangeRequest(key=b(key), count_only=count_only, keys_only=keys_only)
    if prefix:
        req.range_end = prefix_end(key)
    return etcdrpc.RequestOp(request_range=req)


def page(prefix: str, after: str, limit: int) -> Op:
    """Read, inside a transaction, at most `limit` keys under `prefix`, in key order, from
    the first that sorts after `prefix + after` (`after` empty: from the first key)."""
    start = f"{prefix}{after}\0" if after else prefix
    req = etcdrpc.RangeRequest(key=b(start), range_end=prefix_end(prefix), limit=limit)
    return etcdrpc.RequestOp(request_range=req)


def txn_request(compare: list[Cmp], success: list[Op], failure: list[Op] | None = None) -> Any:
    return etcdrpc.TxnRequest(compare=compare, success=success, failure=failure or [])


def nested(compare: list[Cmp], success: list[Op], failure: list[Op] | None = None) -> Op:
    """A transaction inside a transaction's branch (etcd ≥ 3.3)."""
    return etcdrpc.RequestOp(request_txn=txn_request(compare, success, failure))
