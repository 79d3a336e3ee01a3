"""`tensorhub bench reshard`: its committed vLLM layout fixture (`bench.reshard_layout`), the
trainer's placements, and one short run on emulated hosts whose byte accounting must add
up (the run itself fails unless every worker's blocks equal the trainer's bytes). The
emulated run needs root (netns), skipped otherwise."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from bench import reshard
from bench.common import Options
from bench.report import Result
from bench.reshard_layout import (
    FIXTURE,
    bench_model,
    load,
    parse,
    trainer_placements,
)
from tensorhub.errors import InvalidArgument
from transport.boxes import Box

Q = "model.layers.0.self_attn.q_proj.weight"
K = "model.layers.0.self_attn.k_proj.weight"
OPROJ = "model.layers.0.self_attn.o_proj.weight"


def test_the_fixture_is_vllms_tp2_layout_with_its_kv_head_replicated() -> None:
    recorded = load()
    assert sorted(recorded.workers) == [2, 4]
    r0, r1 = recorded.workers[2]
    assert r0[Q] == Box((0, 0), (256, 512))
    assert r1[Q] == Box((256, 0), (256, 512))
    assert r0[OPROJ] == Box((0, 0), (512, 256))
    assert r1[OPROJ] == Box((0, 256), (512, 256))
    whole_k = Box((0, 0), recorded.shapes[K])
    assert all(w[K] == whole_k for w in recorded.workers[4])  # one KV head, replicated


def test_a_fixture_whose_workers_do_not_cover_a_tensor_is_refused() -> None:
    data: dict[str, Any] = json.loads(FIXTURE.read_text())
    data["layouts"]["vllm-tp2"][1][Q] = [[0, 0], [256, 512]]  # both ranks the same rows
    with pytest.raises(InvalidArgument, match="cover"):
        parse(data)
    data = json.loads(FIXTURE.read_text())
    data["layouts"]["vllm-tp2"][0][Q] = [[300, 0], [256, 512]]
    with pytest.raises(InvalidArgument, match="outside"):
        parse(data)


def test_the_bench_model_repeats_the_recorded_layer_and_the_trainer_covers_it() -> None:
    model = bench_model(load(), 2, 3)
    assert f"model.layers.2.{Q.removeprefix('model.layers.0.')}" in model.workers[1]
    assert model.block_bytes(0) == model.block_bytes(1) < model.nbytes
    for name, shape in model.shapes.items():
        boxes = [trainer_placements(model.shapes, rank, 4)[name][1] for rank in range(4)]
        whole = Box((0,) * len(shape), shape)
        if all(b == whole for b in boxes):
            continue  # replicated: norms, the one KV head
        assert sum(b.volume for b in boxes) == whole.volume, name
        assert all(b.within(shape) for b in boxes)
    with pytest.raises(InvalidArgument, match="TP 8"):
        bench_model(load(), 8, 1)


def test_bad_flags_are_refused() -> None:
    import argparse

    ap = argparse.ArgumentParser()
    reshard.add_arguments(ap)
    with pytest.raises(InvalidArgument):
        reshard.config(ap.parse_args(["--readers", "1,x"]))
    with pytest.raises(InvalidArgument):
        reshard.config(ap.parse_args(["--readers", "0"]))
    with pytest.raises(InvalidArgument):
        reshard.config(ap.parse_args(["--rate-floor", "-1"]))
    assert reshard.config(ap.parse_args(["--readers", "4,1"])).readers == (1, 4)


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.skipif(os.geteuid() != 0, reason="emulated hosts need root (netns, tc)")
def test_a_short_run_accounts_for_every_byte() -> None:
    """One step per R in {1, 2} from a one-host trainer: each worker read at least its
    blocks, its host's link carried at least what it read, the trainer's link carried at
    least what the workers read from it, readers without a layout read only from it, and
    of two instances one after another the second read exactly its blocks, none of them
    from the trainer; each worker's start delay and end are recorded."""
    cfg = reshard.Config(trainer_hosts=1, readers=(1, 2), steps=1)
    res = reshard.run(Options(rate_mbit=400, size_mb=8), cfg)
    d = res.details
    model, blocks = d["model_bytes"], d["block_bytes"]
    assert sorted(d["T"]) == sorted([*reshard.PATHS, reshard.STAGGERED])
    for path, by_r in d["steps"].items():
        assert sorted(by_r) == ([2] if path == reshard.STAGGERED else [1, 2])
        for r, [step] in by_r.items():
            assert len(step["worker_in_per_blocks"]) == 2 * r
            read = step["worker_read_per_blocks"]
            direct = step["worker_from_trainer_per_blocks"]
            assert all(x >= 1.0 for x in read), (path, r, step)
            assert all(i >= x for i, x in zip(step["worker_in_per_blocks"], read, strict=True))
            # every worker asked for chunks after its fetch's call, and ended within T
            assert all(d is not None and d >= 0 for d in step["worker_start_delay_s"]), step
            assert max(step["worker_end_s"]) == pytest.approx(step["T_s"], abs=1e-3)
            from_trainer = sum(x * blocks[k % 2] for k, x in enumerate(direct))
            assert step["trainer_out_per_model"] * model >= from_trainer
            if path == "slices":
                assert direct == read  # they hold nothing: every byte from the trainer
            if path == reshard.STAGGERED:  # the second instance reads the first's blocks
                assert direct[2:] == [0, 0], step
                assert read[2:] == [1.0, 1.0], step
    names = [f.name for f in res.figures]
    assert "layout T(2)/T(1)" in names
    assert "slices T(2)/T(1)" in names


def test_the_plot_draws_both_paths(tmp_path: Path) -> None:
    from tests.bench.test_plots import chunks

    res = Result("reshard", "tensorhub bench reshard")
    res.details = {  # as `--json` writes them: R as strings
        "T": {"layout": {"1": 1.2, "8": 6.7}, "slices": {"1": 1.2, "2": 1.6, "8": 6.0}},
        "model_bytes": 18 << 20,
        "trainer_hosts": 4,
    }
    path = tmp_path / "reshard.png"
    drawn = reshard.plot(res, path)
    texts = dict(t.split(b"\0", 1) for t in chunks(path.read_bytes())[b"tEXt"])
    embedded = json.loads(texts[b"tensorhub-series"])
    assert set(embedded) == set(reshard.SERIES)
    assert drawn["slices (readers hold nothing)"] == {1: 1.2, 2: 1.6, 8: 6.0}
