"""The view of a model-parallel weight (`ros.views.sharded`, docs/views.md): two ranks in a
real gloo process group, each quantizing its own slice, make the view of the whole weight
bit for bit, the scales of the blocks their slices split agreed over the group."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from ros.views import quantize_fp8_block128, quantize_mxfp8
from tests.gloo_ranks import rendezvous_store
from tests.views.shard_rank_proc import CASES, part, weight

pytestmark = pytest.mark.slow  # two torch processes start (about 15 s on 2 shared cores)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, object]]:
    """What each of 2 rank processes got for every case (`tests/views/shard_rank_proc.py`)."""
    out = tmp_path_factory.mktemp("ranks")
    store = rendezvous_store(timedelta(seconds=60))  # both ranks connect to it
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port)}  # fmt: skip
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.views.shard_rank_proc", str(out)],
            env={**env, "RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for rank in range(2)
    ]
    said = []
    for proc in procs:
        try:
            said.append(proc.communicate(timeout=60)[0].decode(errors="replace"))
        finally:
            proc.kill()
    assert [p.returncode for p in procs] == [0, 0], said
    return [torch.load(Path(out) / f"rank-{r}.pt") for r in range(2)]


def _whole(case: str) -> tuple[torch.Tensor, torch.Tensor]:
    fmt = CASES[case][0]
    quantize = quantize_fp8_block128 if fmt == "fp8-block128" else quantize_mxfp8
    return quantize(weight(case))


FINITE = [c for c in CASES if "nan" not in c]


@pytest.mark.parametrize("case", FINITE)
def test_the_ranks_parts_are_the_view_of_the_whole_weight(
    ranks: list[dict[str, object]], case: str
) -> None:
    fmt, _, dim, _ = CASES[case]
    q_whole, scale_whole = _whole(case)
    br, bc = (128, 128) if fmt == "fp8-block128" else (1, 32)
    q_parts = []
    for rank in range(2):
        got = ranks[rank][case]
        assert isinstance(got, tuple), got
        q, scale = got
        local, (r0, c0) = part(case, rank)
        n, k = local.shape
        assert q.shape == local.shape
        assert q.dtype == q_whole.dtype
        want = scale_whole[r0 // br : -(-(r0 + n) // br), c0 // bc : -(-(c0 + k) // bc)]
        assert scale.dtype == want.dtype
        assert scale.shape == want.shape
        assert torch.equal(scale.view(torch.uint8), want.contiguous().view(torch.uint8))
        q_parts.append(q)
    q_all = torch.cat(q_parts, dim=dim)
    assert torch.equal(q_all.view(torch.uint8), q_whole.view(torch.uint8))
    if case.endswith("split-block"):  # a split block's pieces alone would scale differently
        local, _ = part(case, 0)
        alone = quantize_fp8_block128(local) if fmt == "fp8-block128" else quantize_mxfp8(local)
        assert not torch.equal(alone[0].view(torch.uint8), q_parts[0].view(torch.uint8))


def test_a_nan_on_one_rank_is_refused_by_every_rank(ranks: list[dict[str, object]]) -> None:
    """No rank is left in a collective: the rank holding the NaN names it, the other says
    another rank's slice holds one."""
    mine, other = ranks[1]["fp8-nan-on-rank-1"], ranks[0]["fp8-nan-on-rank-1"]
    assert isinstance(mine, str)
    assert "fp8-nan-on-rank-1[200, 7] is nan" in mine
    assert isinstance(other, str)
    assert "another rank's slice" in other


def test_one_call_for_many_weights_makes_what_one_call_each_makes(
    ranks: list[dict[str, object]],
) -> None:
    """`quantize_shards` (two collectives for all the weights of a format) equals
    `quantize_shard` of each weight, on every rank."""
    for rank in range(2):
        for fmt in ("fp8-block128", "mxfp8"):
            batched = ranks[rank][f"batched {fmt}"]
            assert isinstance(batched, dict)
            assert sorted(batched) == sorted(c for c in FINITE if CASES[c][0] == fmt)
            for case, (q, scale) in batched.items():
                one = ranks[rank][case]
                assert isinstance(one, tuple)
                assert torch.equal(q.view(torch.uint8), one[0].view(torch.uint8)), case
                assert torch.equal(scale.view(torch.uint8), one[1].view(torch.uint8)), case
