"""Delta versions in the chaos workload (chaos/deltas.py), without a cluster: the versions a
publisher makes are worth a delta and still tell apart, a delta read with other bytes is a
torn read like any other, and the report counts delta reads and says when a run had none."""

from __future__ import annotations

from typing import Any

import torch

from chaos.checker import Facts, check
from chaos.deltas import Weights, delta_counts
from chaos.history import OK, Op
from chaos.report import checked, delta_warning, summary, to_json
from chaos.runner import FaultRecord, RunConfig, RunResult
from chaos.worker import CHUNK, SHAPES, digest
from transport import delta as codec

_ids = iter(range(1, 10_000))


def op(client: str, f: str, t: float, args: dict[str, Any], **value: Any) -> Op:
    return Op(next(_ids), client, f, t, 10.0, args, OK, t + 0.1, value)


def publish(version: int, content: str, delta_base: int = 0) -> Op:
    args = {"model": "policy", "version": version, "hash": content, "delta": True}
    return op("publisher-0#1", "publish", version, args, version=version,
              revision=version * 10, delta_base=delta_base)  # fmt: skip


def fetch(version: int, content: str, **delta: Any) -> Op:
    stats = {"base": 0, "links": 0, "chunks": 0, "encoded_bytes": 0, "whole_chunks": 0,
             "base_mismatch": 0, "fallback": "", **delta} if delta else None  # fmt: skip
    record = {"delta": stats} if stats else {}
    args = {"model": "policy", "version": version, "mode": "in-place"}
    return op("reader-0#1", "fetch", version + 0.5, args, version=version, hash=content, **record)


def result(ops: list[Op], faults: list[FaultRecord] | None = None, **config: Any) -> RunResult:
    violations = check(Facts(ops))
    return RunResult(RunConfig(**config), 0.0, 10.0, faults or [], {}, ops, violations, [], "/tmp")


def test_each_version_is_a_small_change_worth_a_delta_and_all_are_told_apart() -> None:
    """About 1 % of every chunk changes (it encodes small) and one chunk is rewritten whole
    (it goes whole), every version hashes differently, a published version's tensors are
    never written again, and two publishers' versions share nothing."""
    one, other = Weights(SHAPES, CHUNK, 1), Weights(SHAPES, CHUNK, 2)
    versions = [one.next() for _ in range(4)]
    kept = {name: t.clone() for name, t in versions[0].items()}
    assert all(torch.equal(versions[0][n], kept[n]) for n in kept)  # not written again
    assert len({digest(v) for v in versions} | {digest(other.next())}) == 5
    before, after = versions[-2], versions[-1]
    encoded, whole = 0, 0
    for name in ("w0", "w1", "w2"):
        for at in range(0, before[name].numel(), CHUNK):
            old, new = before[name][at : at + CHUNK], after[name][at : at + CHUNK]
            assert not torch.equal(old, new)  # every chunk changes
            small = codec.encode([old], [new])
            encoded += small is not None
            whole += small is None
            if small is not None:
                assert len(small) < 0.2 * CHUNK
    assert whole == 1
    assert encoded == 13
    assert (before["w0"] != other.current["w0"]).float().mean() > 0.9


def test_a_delta_read_with_other_bytes_is_a_torn_read() -> None:
    """Invariant 1 holds delta reads to the published bytes of their version like any read."""
    ops = [
        publish(1, "h1"),
        publish(2, "h2", delta_base=1),
        fetch(1, "h1"),
        fetch(2, "h2", base=1, links=1, chunks=13, whole_chunks=2),
        fetch(2, "h1-patched", base=1, links=1, chunks=13, whole_chunks=2),
    ]
    found = check(Facts(ops))
    assert [v.kind for v in found] == ["torn-read"]
    assert found[0].ops[0] is ops[-1]


def test_the_report_counts_delta_reads() -> None:
    ops = [
        publish(1, "h1"),
        publish(2, "h2", delta_base=1),
        publish(3, "h3", delta_base=2),
        fetch(1, "h1"),
        fetch(2, "h2", base=1, links=1, chunks=13, whole_chunks=2),
        fetch(3, "h3", base=1, links=2, chunks=12, whole_chunks=3, base_mismatch=1),
        fetch(3, "h3", base=2, fallback="no chain of at most 8 deltas leads from 2"),
    ]
    counts = delta_counts(ops)
    assert counts["publishes with a delta"] == 2
    assert counts["fetches that applied a delta"] == 2
    assert counts["of those, a chain of 2 or more deltas"] == 1
    assert counts["fetches that found their memory not the base (chunks read whole)"] == 1
    assert counts["fetches whose delta was not used (read whole)"] == 1
    kill = FaultRecord("kill-holder", "holder", "publisher-0", 2.4, 2.7)  # over fetch(2)
    failed = FaultRecord("kill-hub", "global", "", 3.5, 3.6, "not injected")
    run = result(ops, [kill, failed])
    assert run.violations == []
    assert checked(run)["fetches that applied a delta (1)"] == 2
    assert checked(run)["of those, while a fault was injected (1)"] == 1
    assert "fetches that applied a delta (1): 2" in summary(run)
    assert delta_warning(run) == ""
    assert to_json(run)["warnings"] == []


def test_a_run_that_never_applied_a_delta_says_so() -> None:
    """Deltas tried but never applied (or never tried): the report warns, so a run (or a
    test) cannot pass for one that checked delta reads."""
    ops = [
        publish(1, "h1"),
        publish(2, "h2", delta_base=1),
        fetch(1, "h1"),
        fetch(2, "h2", base=1, fallback="no chain of at most 8 deltas leads from 1"),
    ]
    run = result(ops)
    assert delta_warning(run).startswith("WARNING: no fetch applied a delta")
    assert delta_warning(run) in summary(run)
    assert to_json(run)["warnings"] == [delta_warning(run)]
    assert delta_warning(result(ops, delta=False)) == ""  # --no-delta: none expected
    assert "fetches that applied a delta (1)" not in checked(result(ops, delta=False))
