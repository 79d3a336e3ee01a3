"""The check of the readers in a second layout (`chaos.layout_readers`): every block they
ended with has the ranks' bytes.

A `fetch-layout` that completed names its version, the ranks and the block set it took; the
ranks' tensors are a function of (model, version, rank) (`chaos.shards.shard_tensors`), so
each block's bytes are recomputed here, from the ranks' tensors alone, and its content hash
compared with the one the reader took of its memory after the fetch (`torn-read`,
invariant 1). A block read from another layout reader, from the trainer's shards or from
both is held to the same bytes. Whether the version was whole when the fetch saw it is
checked with the shards' reads (`chaos.checker_shards`, `partial-version`).

`layout_counts` gives the report its evidence: the layout fetches compared, those that read
from another layout reader, and the failed ones (a named error is no violation).
"""

from __future__ import annotations

from functools import lru_cache

from chaos.facts import Violation
from chaos.history import FAIL, MP_MODEL, OK, Op
from chaos.layout_readers import block_hashes, expected_blocks

READER_ROLE = "layout-reader"


@lru_cache(maxsize=256)
def _expected(version: int, ranks: int, block_set: int) -> tuple[tuple[str, str], ...]:
    """(name, hash) of each block of a set, as the ranks' tensors make it (cached: a run
    compares every version's sets several times)."""
    return tuple(sorted(block_hashes(expected_blocks(MP_MODEL, version, ranks, block_set)).items()))


def check_layouts(ops: list[Op]) -> list[Violation]:
    """Every block a layout fetch returned hashes to the ranks' bytes of its version."""
    out = []
    for op in ops:
        if op.f != "fetch-layout" or op.outcome != OK or op.args.get("model") != MP_MODEL:
            continue
        version, ranks, block_set = (
            int(op.value["version"]), int(op.args["ranks"]), int(op.args["set"])
        )  # fmt: skip
        what = f"block set {block_set} of {MP_MODEL}@{version} in {op.args.get('layout')}"
        if version != int(op.args["version"]):
            out.append(
                Violation("torn-read", f"asked for version {op.args['version']}, got {what}", [op])
            )
            continue
        want = dict(_expected(version, ranks, block_set))
        got = {str(k): str(v) for k, v in dict(op.value.get("hashes", {})).items()}
        wrong = sorted(name for name in want.keys() | got.keys() if want.get(name) != got.get(name))
        if wrong:
            out.append(
                Violation(
                    "torn-read",
                    f"fetched {what}: block(s) {wrong} differ from the ranks' bytes",
                    [op],
                )
            )
    return out


def layout_counts(ops: list[Op]) -> dict[str, int]:
    """The layout readers' evidence for the report."""
    fetches = [op for op in ops if op.f == "fetch-layout"]
    ok = [op for op in fetches if op.outcome == OK]
    return {
        "layout fetches compared with the ranks' bytes (1)": len(ok),
        "of those, read in part or whole from another layout reader": sum(
            any(str(s).startswith(READER_ROLE) for s in op.value.get("sources", {})) for op in ok
        ),
        "of those, serving their blocks after": sum(bool(op.value.get("served")) for op in ok),
        "failed layout fetches (a named error)": sum(op.outcome == FAIL for op in fetches),
    }


def layout_warning(ops: list[Op], readers: int) -> str:
    """A warning when a run with layout readers has no layout fetch that succeeded ("" when
    it has one, or no readers): it checked nothing about blocks in another layout."""
    if not readers or any(op.f == "fetch-layout" and op.outcome == OK for op in ops):
        return ""
    return (
        "WARNING: no layout fetch succeeded; the run checked no block of the second layout "
        "against the ranks' bytes"
    )
