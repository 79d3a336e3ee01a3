"""One rank of tests/views/test_sharded_views.py: joins a gloo process group of the ranks
(torch.distributed's environment: `RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`),
builds the same seeded weights as the test (`CASES`), quantizes its slice of each with
`ros.views.sharded.quantize_shard`, and saves what it got to OUT/rank-R.pt: for each case
(q, scale) or the error's text; and, under "batched FORMAT", what `quantize_shards` made of
all that format's finite cases in one call. Run as `python -m tests.views.shard_rank_proc OUT`."""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from ros.views.sharded import ShardSlice, quantize_shard, quantize_shards
from tensorhub.errors import InvalidArgument
from tests.gloo_ranks import join_group

# case -> (format, global shape, dimension split, where rank 1's slice starts)
CASES: dict[str, tuple[str, tuple[int, int], int, int]] = {
    "fp8-rows-split-block": ("fp8-block128", (300, 260), 0, 150),
    "fp8-cols-split-block": ("fp8-block128", (200, 300), 1, 130),
    "fp8-rows-aligned": ("fp8-block128", (300, 260), 0, 128),
    "mxfp8-cols-split-block": ("mxfp8", (64, 100), 1, 50),
    "mxfp8-rows": ("mxfp8", (70, 96), 0, 33),
    "fp8-empty-rank-1": ("fp8-block128", (128, 256), 0, 128),
    "fp8-nan-on-rank-1": ("fp8-block128", (256, 256), 0, 128),
}


def weight(case: str) -> torch.Tensor:
    """The case's whole weight in bf16: seeded, one small-magnitude block row, so that the
    two pieces of a split block have different amaxes."""
    _, shape, _, _ = CASES[case]
    g = torch.Generator().manual_seed(sum(map(ord, case)))
    w = torch.randn(*shape, generator=g) * 0.02
    w[: shape[0] // 3] *= 1e-3
    w[:, : shape[1] // 5] *= 50.0
    out = w.to(torch.bfloat16)
    if case == "fp8-nan-on-rank-1":
        out[200, 7] = float("nan")
    return out


def part(case: str, rank: int) -> tuple[torch.Tensor, tuple[int, int]]:
    """Rank `rank`'s slice of the case's weight (of 2) and its offsets."""
    _, _, dim, cut = CASES[case]
    w = weight(case)
    size = w.shape[dim]
    start, stop = (0, cut) if rank == 0 else (cut, size)
    local = w.narrow(dim, start, stop - start).contiguous()
    return local, ((start, 0) if dim == 0 else (0, start))


def _slice(case: str, rank: int) -> tuple[torch.Tensor, tuple[int, int], tuple[int, int]]:
    local, offsets = part(case, rank)
    return local, CASES[case][1], offsets


def main(out: str) -> None:
    rank, _ = join_group(timedelta(seconds=30))
    got: dict[str, object] = {}
    try:
        for case, (fmt, shape, _, _) in CASES.items():
            local, offsets = part(case, rank)
            try:
                got[case] = quantize_shard(local, shape, offsets, fmt, name=case)
            except InvalidArgument as exc:
                got[case] = str(exc)
        for fmt in ("fp8-block128", "mxfp8"):
            cases = [c for c, spec in CASES.items() if spec[0] == fmt and "nan" not in c]
            slices = [ShardSlice(c, *_slice(c, rank)) for c in cases]
            got[f"batched {fmt}"] = dict(zip(cases, quantize_shards(slices, fmt), strict=True))
        torch.save(got, os.path.join(out, f"rank-{rank}.pt"))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
