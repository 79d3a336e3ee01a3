"""The rollouts simulator (`bench.sim.rollouts`): readers in another layout chained behind
each other against every reader on the trainer, the delta step's parts, and the
calibration's arithmetic against a bench's JSON report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.sim import cli as sim_cli
from bench.sim.rollouts import (
    GB,
    PAYLOAD,
    RolloutParams,
    calibrate_delta,
    calibrate_reshard,
    rollouts,
    transfer,
)
from tensorhub.errors import InvalidArgument

SMALL = RolloutParams(model_gb=8.0, trainer_gpus=8, rollout_gpus=64, tp=8, nic_gbps=100.0)


def test_layout_readers_chain_so_the_trainer_sends_each_block_set_once() -> None:
    p = SMALL
    ros = transfer(p, p.block_bytes, pipelined=True)
    pull = transfer(p, p.block_bytes, pipelined=False)
    hops = p.instances - 1  # each later reader one chunk behind the one before
    chunk_time = p.chunk_mb * 1e6 / p.nic
    assert ros["last_s"] == pytest.approx(p.block_bytes / p.nic + hops * chunk_time, rel=1e-6)
    assert ros["trainer_out_per_model"] == pytest.approx(1.0)
    # every instance on the trainer: its share of the uplinks for this block set, split R ways
    trainer = p.trainer_gpus * p.nic / p.tp
    assert pull["last_s"] == pytest.approx(p.instances * p.block_bytes / trainer, rel=1e-6)
    assert pull["trainer_out_per_model"] == pytest.approx(p.instances)


def test_a_delta_step_is_encode_then_fixed_cost_then_wire_overlapped_with_apply() -> None:
    p = RolloutParams(**{**SMALL.__dict__, "delta_fraction": 0.01})
    out = rollouts(p)
    parts = out["delta_parts_s"]
    assert parts["encode"] == pytest.approx(p.model_gb / p.trainer_gpus / p.encode_gbps)
    assert parts["apply"] == pytest.approx(p.block_bytes / GB / p.apply_gbps)
    wire = transfer(p, p.block_bytes * 0.01, pipelined=True)["last_s"]
    assert parts["wire"] == pytest.approx(wire)
    overlapped = parts["encode"] + parts["fixed"] + max(parts["wire"], parts["apply"])
    assert out["stall_s"]["delta"] == pytest.approx(overlapped)
    assert out["stall_s"]["whole"] < out["stall_s"]["whole_from_trainer"]


LINK = 200e6 * PAYLOAD / 8  # bytes/s through a shaped 200 Mbit/s link


def _run(encoded: int, apply_s: float, fetch_s: float, whole_s: float) -> dict[str, object]:
    steps = [{"encoded_bytes": 4 * encoded, "used_delta": 4, "fetch_s": [fetch_s]}] * 3
    return {"steps": steps, "full": [{"fetch_s": [whole_s]}], "summary": {"apply_s": apply_s}}


def _delta_report(runs: dict[str, object]) -> dict[str, object]:
    details = {"readers": 4, "rate_mbit": 200.0, "chunk_bytes": 256 * 1024,
               "model": {"bf16_bytes": 8 * 2**20}, "runs": runs}  # fmt: skip
    return {"bench": "delta", "details": details}


def test_calibrate_delta_fits_the_fixed_cost_on_the_first_rate_and_checks_the_rest() -> None:
    chain = 3 * 256 * 1024 / LINK  # 4 readers chained, each a chunk behind
    small = 4 * 100_000 / LINK  # a companion under a chunk is forwarded whole at each hop
    big = 4 * 2**20 / LINK + chain
    whole = 8 * 2**20 / LINK + chain
    fixed = 0.15
    runs = {
        "lr 1e-06": _run(100_000, 0.2, fixed + max(small, 0.2), whole * 1.3),
        "lr 1e-04": _run(4 * 2**20, 0.1, 0.9 * (fixed + max(big, 0.1)), whole * 1.3),
    }
    fit, delta, full = calibrate_delta(_delta_report(runs))
    assert fit.fitted
    assert fit.ok
    assert delta.simulated_s == pytest.approx(fixed + big, rel=1e-6)
    assert delta.error == pytest.approx(1 / 0.9 - 1, rel=1e-6)
    assert delta.ok
    assert full.simulated_s == pytest.approx(whole, rel=1e-6)
    assert not full.ok  # 30 % off is outside the 15 %


def test_calibrate_reshard_simulates_what_each_worker_read_from_each_holder() -> None:
    mib = 2**20
    one = [{"t0": 8 * mib}, {"t1": 8 * mib}]  # R = 1: each TP rank's worker on its own host
    two = [{"t0": 8 * mib}, {"t0": 4 * mib, "t1": 4 * mib}] * 2  # t0 serves 6 of 8 reads
    steps = {"1": [{"worker_bytes_by_source": one}] * 3,
             "2": [{"worker_bytes_by_source": two}] * 3}  # fmt: skip
    details = {"rate_mbit": 200.0, "steps": {"slices": steps},
               "T": {"slices": {"1": 0.5, "2": 10.0}}}  # fmt: skip
    r1, r2 = calibrate_reshard({"details": details})
    assert r1.simulated_s == pytest.approx(8 * mib / LINK, rel=1e-6)
    # t0's uplink carries 24 MiB: the holder the planner loads most binds, not the mean
    assert r2.simulated_s == pytest.approx(24 * mib / LINK, rel=1e-6)
    assert not r1.ok
    assert not r2.ok
    del steps["2"][0]["worker_bytes_by_source"]
    with pytest.raises(InvalidArgument, match="worker_bytes_by_source"):
        calibrate_reshard({"details": details})


def test_the_cli_prints_and_refuses_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert sim_cli.main(["rollouts", "--rollout-gpus", "64", "--model-gb", "8"]) == 0
    assert "stall_s: whole" in capsys.readouterr().out
    with pytest.raises(InvalidArgument, match="--delta-json"):
        sim_cli.main(["calibrate"])
    report = tmp_path / "r.json"
    report.write_text(json.dumps({"results": [{"bench": "fanout", "details": {}}]}))
    with pytest.raises(InvalidArgument, match="no `bench delta` result"):
        sim_cli.main(["calibrate", "--delta-json", str(report)])
    report.write_text(json.dumps({"results": [_delta_report({"lr 1": _run(10, 0.1, 0.2, 1.0)})]}))
    assert sim_cli.main(["calibrate", "--delta-json", str(report)]) in (0, 1)
    assert "simulated" in capsys.readouterr().out
