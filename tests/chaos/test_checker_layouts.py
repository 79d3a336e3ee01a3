"""The check of the readers in a second layout (`chaos.checker_layouts`) on a history written
to a real file by the workers' own recorder: a block whose hash is not the ranks' bytes is a
torn read; the blocks as the ranks' tensors make them pass; a run whose layout readers never
fetched is warned about."""

from __future__ import annotations

from pathlib import Path

import torch

from chaos.checker import Facts, check
from chaos.checker_layouts import layout_counts, layout_warning
from chaos.history import FAIL, MP_MODEL, OK, Op, Recorder, load_ops
from chaos.layout_readers import LAYOUT, block_boxes, block_hashes, expected_blocks
from chaos.shards import shard_tensors
from chaos.worker import digest

RANKS = 3


def _write(path: Path, version: int, block_set: int, hashes: dict[str, str]) -> None:
    """Every rank's shard publish of `version` (the last makes it visible), then a layout
    reader's fetch of `block_set` that ended with blocks of these `hashes`."""
    for rank in range(RANKS):
        rec = Recorder(path.with_name(f"rank-{rank}.jsonl"), f"rank-{rank}#1")
        content = digest(shard_tensors(MP_MODEL, version, rank))
        op = rec.invoke(
            "publish-shard", 10.0, model=MP_MODEL, version=version, shard=rank, shards=RANKS,
            hash=content,
        )  # fmt: skip
        rec.complete(op, OK, version=version, revision=10 + rank, visible=rank == RANKS - 1)
        rec.close()
    rec = Recorder(path, "layout-reader-1#1")
    op = rec.invoke(
        "fetch-layout", 20.0, model=MP_MODEL, version=version, layout=LAYOUT, ranks=RANKS,
        set=block_set,
    )  # fmt: skip
    rec.complete(
        op, OK, version=version, hashes=hashes, served=True,
        sources={"layout-reader-0-g1-abcd": 50152}, from_trainer=[], failed_sources=[],
    )  # fmt: skip
    failed = rec.invoke("fetch-layout", 20.0, model=MP_MODEL, version=version + 1, layout=LAYOUT,
                        ranks=RANKS, set=0)  # fmt: skip
    rec.complete(failed, FAIL, "VersionUnavailable: no holder left")
    rec.close()


def _ops(tmp_path: Path) -> list[Op]:
    return load_ops(sorted(tmp_path.glob("*.jsonl")))


def test_blocks_cut_across_two_ranks_shards_are_the_ranks_bytes() -> None:
    """The geometry itself: set 1 of 3 ranks is the second half of rank 1's tensors and the
    first half of rank 2's."""
    blocks = expected_blocks(MP_MODEL, 4, RANKS, 1)
    one, two = shard_tensors(MP_MODEL, 4, 1), shard_tensors(MP_MODEL, 4, 2)
    for name, block in blocks.items():
        half = one[name].numel() // 2
        assert block_boxes(RANKS, 1)[name] == (one[name].numel() + half, one[name].numel())
        assert torch.equal(block, torch.cat([one[name][half:], two[name][:half]]))


def test_a_block_read_with_the_ranks_bytes_passes(tmp_path: Path) -> None:
    hashes = block_hashes(expected_blocks(MP_MODEL, 7, RANKS, 1))
    _write(tmp_path / "layout-reader-1.jsonl", 7, 1, hashes)
    ops = _ops(tmp_path)
    assert check(Facts(ops)) == []
    assert layout_counts(ops) == {
        "layout fetches compared with the ranks' bytes (1)": 1,
        "of those, read in part or whole from another layout reader": 1,
        "of those, serving their blocks after": 1,
        "failed layout fetches (a named error)": 1,
    }
    assert layout_warning(ops, 2) == ""


def test_a_block_whose_hash_differs_from_the_ranks_bytes_is_a_torn_read(tmp_path: Path) -> None:
    hashes = block_hashes(expected_blocks(MP_MODEL, 7, RANKS, 1))
    wrong = expected_blocks(MP_MODEL, 7, RANKS, 1)["w"].clone()
    wrong[5] ^= 0xFF  # one byte of one block flipped
    hashes["w"] = block_hashes({"w": wrong})["w"]
    _write(tmp_path / "layout-reader-1.jsonl", 7, 1, hashes)
    found = check(Facts(_ops(tmp_path)))
    assert [(v.kind, v.invariant) for v in found] == [("torn-read", 1)]
    assert "block(s) ['w'] differ from the ranks' bytes" in found[0].message
    assert [op.f for op in found[0].ops] == ["fetch-layout"]


def test_another_block_sets_bytes_are_a_torn_read(tmp_path: Path) -> None:
    """Right bytes of the wrong blocks (set 0's, recorded as set 1) are not set 1's."""
    _write(
        tmp_path / "layout-reader-1.jsonl",
        7,
        1,
        block_hashes(expected_blocks(MP_MODEL, 7, RANKS, 0)),
    )
    assert [v.kind for v in check(Facts(_ops(tmp_path)))] == ["torn-read"]


def test_a_run_whose_layout_readers_never_fetched_is_warned_about(tmp_path: Path) -> None:
    rec = Recorder(tmp_path / "layout-reader-0.jsonl", "layout-reader-0#1")
    op = rec.invoke("fetch-layout", 20.0, model=MP_MODEL, version=1, layout=LAYOUT, ranks=2, set=0)
    rec.complete(op, FAIL, "VersionUnavailable: no holder left")
    rec.close()
    ops = _ops(tmp_path)
    assert layout_warning(ops, 2).startswith("WARNING: no layout fetch succeeded")
    assert layout_warning(ops, 0) == ""  # no layout readers: nothing expected
