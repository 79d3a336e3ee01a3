"""`tensorhub bench delta`: its flags, its plot, and the real bench at a tiny size.

The smoke run trains the tiny model of the same kind (`bench.emu.training.TINY`, 0.9 MiB)
for 2 steps at two learning rates and 2 readers fetch each step on emulated hosts (root
needed, skipped otherwise): every figure row is there and every reader's bytes equal the
trainer's at every step. The performance targets are the bench's printed ratios, never
asserted here (a 0.9 MiB model says nothing about them).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from bench import cli, delta
from bench.common import Options
from bench.emu import training
from bench.report import Result


def test_delta_is_a_bench_of_its_own_and_of_all() -> None:
    assert "delta" in cli.NAMES
    assert cli.EMULATED["delta"] is delta.run  # `bench all` runs every EMULATED one
    args = cli._parse("delta", ["--tiny", "--steps", "3", "--readers", "2", "--lrs", "1e-6"])
    cfg = delta.config(args)
    assert cfg == delta.Config(3, 2, (1e-6,), training.TINY)
    assert cfg.full_at == (1, 2, 3)
    assert cfg.flags() == " --steps 3 --readers 2 --lrs 1e-06 --tiny"
    assert delta.config(cli._parse("delta", [])) == delta.Config()
    with pytest.raises(SystemExit):
        cli._parse("delta", ["--lrs", "fast"])


def test_the_default_model_is_a_real_transformer_of_at_least_64_mib() -> None:
    spec = training.DEFAULT
    assert spec.nbytes >= 64 << 20
    if training.missing():
        pytest.skip(training.missing())
    model = training.Training(training.TINY, 1e-4)  # the same code, small
    weights = model.weights()
    assert sum(t.numel() for t in weights.values()) == training.TINY.params
    assert all(p.requires_grad for p in model.model.parameters())
    before = {k: v.clone() for k, v in weights.items()}
    model.step()
    after = model.weights()
    changed = [k for k in after if not after[k].equal(before[k])]
    assert "model.embed_tokens.weight" in changed
    rows = (after["model.embed_tokens.weight"] != before["model.embed_tokens.weight"]).any(1)
    assert bool(rows.all())  # every embedding row moved in one step (tied to the output)


def small_result() -> Result:
    res = Result("delta", "tensorhub bench delta")
    res.details = {
        "readers": 4,
        "model": {"bf16_bytes": 72_635_392},
        "wire": {
            "lr 1e-06": {"1": 12_000_000, "2": 9_000_000, "3": 8_000_000},  # JSON round trip
            "lr 1e-05": {1: 40_000_000, 2: 35_000_000, 3: 33_000_000},
            "lr 0.0001": {1: 90_000_000, 2: 80_000_000, 3: 78_000_000},
        },
    }
    return res


def test_the_delta_plot_is_a_png_with_a_line_per_learning_rate(tmp_path: Path) -> None:
    from tests.bench.test_plots import chunks  # PNG chunks, CRC checked

    path = tmp_path / "delta.png"
    drawn = delta.plot(small_result(), path)
    found = chunks(path.read_bytes())
    assert found[b"IEND"] == [b""]
    texts = dict(t.split(b"\0", 1) for t in found[b"tEXt"])
    embedded = json.loads(texts[b"tensorhub-series"])
    assert set(embedded) == {"lr 1e-06", "lr 1e-05", "lr 0.0001"}
    assert embedded["lr 1e-06"] == {"1": 12_000_000, "2": 9_000_000, "3": 8_000_000}
    assert drawn["lr 1e-05"] == {1: 40_000_000, 2: 35_000_000, 3: 33_000_000}
    import matplotlib.image

    pixels = matplotlib.image.imread(path)
    assert pixels.shape[1] > 300
    assert pixels[..., :3].std() > 0.05


@pytest.mark.timeout(180)
@pytest.mark.skipif(os.geteuid() != 0, reason="emulated hosts need root (netns, tc)")
def test_the_bench_runs_at_a_tiny_size_with_identical_bytes() -> None:
    if why := training.missing():
        pytest.skip(why)
    cfg = delta.Config(steps=2, readers=2, lrs=(1e-6, 1e-4), spec=training.TINY)
    res = delta.run(Options(), cfg)
    names = [f.name for f in res.figures]
    for lr in ("1e-06", "0.0001"):
        for row in ("wire bytes per step / model", "update time, delta / full fetch",
                    "(encode + apply) / one transfer", "delta path / whole fetch"):  # fmt: skip
            assert f"lr {lr}: {row}" in names
        same = next(f for f in res.figures if f.name == f"lr {lr}: fetches with other bytes "
                    "than the trainer's")  # fmt: skip
        assert same.value == 0
        assert same.unit == "of 10"  # 2 readers x (version 1, 2 steps, 2 whole references)
        got = res.details["runs"][f"lr {lr}"]
        assert [s["step"] for s in got["steps"]] == [1, 2]
        assert all(s["used_delta"] == 2 for s in got["steps"]), got["steps"]  # both applied
        assert all(s["companion"] for s in got["steps"])
        assert all(f["used_delta"] == 0 for f in got["full"])  # the reference: whole
        assert all(s["wire_bytes"] > 0 for s in got["steps"])
    wire = res.details["wire"]
    assert set(wire) == {"lr 1e-06", "lr 0.0001"}
    assert wire["lr 1e-06"][2] < wire["lr 0.0001"][2]
