"""etcd's refusals come back named, with the outcome stated (issue 12, item 9).

Each refusal a real etcd can be made to give is provoked on the session's etcd (defaults:
1.5 MiB requests, 128 operations per transaction); the ones it cannot be made to give on
demand (a timed-out proposal, a leader change) are checked through the mapping itself,
`name_refusal`, on etcd's exact wording. Before, each was `TensorHubError("etcd error ...")`,
which the hub answered UNKNOWN ("outcome unknown") although nothing had been written.
"""

from __future__ import annotations

import grpc
import pytest

from consistency import Etcd, Keys, ops
from consistency.refusals import name_refusal
from tensorhub.errors import (
    InvalidArgument,
    OutcomeUnknown,
    StorageFull,
    TensorHubError,
    Unavailable,
    WriteUnconfirmed,
)


def _absent(etcd: Etcd, key: str) -> bool:
    return etcd.get(key)[0] is None


@pytest.mark.parametrize("size", [int(1.6 * (1 << 20)), 3 << 20, 16 << 20])
def test_a_request_over_etcds_limit_is_invalid_argument_and_writes_nothing(
    etcd: Etcd, keys: Keys, size: int
) -> None:
    """1.6 MiB: etcd's own "request is too large"; 3 and 16 MiB: gRPC's message limit,
    before etcd sees it. Both definite."""
    key = f"{keys.prefix}/big"
    with pytest.raises(InvalidArgument, match="nothing was written") as info:
        etcd.put(key, b"x" * size, timeout=10)
    assert "larger than its request limit" in str(info.value)
    assert _absent(etcd, key)


def test_a_transaction_over_128_operations_is_invalid_argument_and_writes_nothing(
    etcd: Etcd, keys: Keys
) -> None:
    puts = [ops.put(f"{keys.prefix}/k{i}", b"v") for i in range(200)]
    with pytest.raises(InvalidArgument, match=r"max-txn-ops.*nothing was written"):
        etcd.txn([], puts, timeout=10)
    assert not etcd.range(f"{keys.prefix}/k", prefix=True).kvs


def test_a_key_twice_in_one_transaction_is_invalid_argument(etcd: Etcd, keys: Keys) -> None:
    key = f"{keys.prefix}/twice"
    with pytest.raises(InvalidArgument, match="names one key twice"):
        etcd.txn([], [ops.put(key, b"a"), ops.put(key, b"b")], timeout=10)
    assert _absent(etcd, key)


@pytest.mark.parametrize(
    ("code", "details", "expected", "words"),
    [
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "etcdserver: mvcc: database space exceeded",
         StorageFull, "nothing was written"),
        (grpc.StatusCode.UNKNOWN, "etcdserver: mvcc: database space exceeded", StorageFull,
         "nothing was written"),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "etcdserver: too many requests", Unavailable,
         "nothing was written"),
        (grpc.StatusCode.UNAVAILABLE, "etcdserver: no leader", Unavailable,
         "nothing was written"),
        (grpc.StatusCode.UNAVAILABLE, "etcdserver: request timed out", WriteUnconfirmed,
         "may or may not"),
        (grpc.StatusCode.UNAVAILABLE,
         "etcdserver: request timed out, possibly due to previous leader failure",
         WriteUnconfirmed, "may or may not"),
        (grpc.StatusCode.UNAVAILABLE, "etcdserver: leader changed", WriteUnconfirmed,
         "may or may not"),
        (grpc.StatusCode.INVALID_ARGUMENT, "etcdserver: request is too large", InvalidArgument,
         "nothing was written"),
    ],
)  # fmt: skip
def test_each_refusal_is_named_with_its_outcome(
    code: grpc.StatusCode, details: str, expected: type[TensorHubError], words: str
) -> None:
    error = name_refusal(code, details)
    assert type(error) is expected
    assert words in str(error)
    assert details in str(error)


def test_other_errors_are_left_to_the_caller() -> None:
    assert name_refusal(grpc.StatusCode.UNAVAILABLE, "connection refused") is None
    assert name_refusal(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") is None


def test_an_unconfirmed_write_is_outcome_unknown_and_an_unconfirmed_read_unavailable() -> None:
    """How `Etcd.txn` turns `WriteUnconfirmed` into the outcome: a transaction that writes
    may have been applied (`OutcomeUnknown`); a read-only one changed nothing."""
    assert issubclass(WriteUnconfirmed, Unavailable)
    assert not issubclass(WriteUnconfirmed, OutcomeUnknown)
    from consistency.etcd import _writes

    assert _writes([ops.get("k"), ops.put("k", b"v")])
    assert _writes([ops.nested([], [ops.delete("k")])])
    assert not _writes([ops.get("k"), ops.get("p", prefix=True)])
