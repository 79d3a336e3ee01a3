"""`tensorhub bench sim [standalone|elastic|crossdc|all|rollouts|calibrate] [flags]`: the
simulator.

- `standalone`, `elastic`, `crossdc`, `all` (the default): the three workloads of the ROS
  paper (`bench.sim.scenarios`). Every field of its `Params` is a flag (`--gpus`,
  `--nic-gbps`, `--model-gb`, `--chunk-mb`, `--wan-gbps`, `--joiners`, ...). Prints each
  scenario's figures and its ratio against the best baseline with the target.
- `rollouts`: rollouts in another layout than the trainer's, whole and delta versions
  (`bench.sim.rollouts`; defaults: a 1T-parameter bf16 model, 256 trainer GPUs to 1,024
  rollout GPUs at TP 8, 400 Gbit/s a GPU). Every field of its `RolloutParams` is a flag;
  `--model-gb`, `--nic-gbps` and `--chunk-mb` are the same flags as above, with its own
  defaults. Prints the rollout stall per step.
- `calibrate --delta-json F [--reshard-json G]`: the rollouts model on the emulated
  configurations of `tensorhub bench delta --json` and `bench reshard --json` reports,
  simulated / measured, OK within 15 %; exits 1 if any is not.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.sim.rollouts import (
    CALIBRATION,
    RolloutParams,
    calibrate_delta,
    calibrate_reshard,
    rollouts,
)
from bench.sim.scenarios import SCENARIOS, Params
from tensorhub.errors import InvalidArgument

SHARED = {"model_gb", "nic_gbps", "chunk_mb"}  # flags of both models, each its own default


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="tensorhub bench sim", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    ap.add_argument("scenario", nargs="?", default="all",
                    choices=[*SCENARIOS, "all", "rollouts", "calibrate"])  # fmt: skip
    for f in dataclasses.fields(Params):
        default = None if f.name in SHARED else f.default
        ap.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=default)
    for f in dataclasses.fields(RolloutParams):
        if f.name not in SHARED:
            ap.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default),
                            default=f.default, help="rollouts")  # fmt: skip
    ap.add_argument("--delta-json", type=Path, help="calibrate: a `bench delta --json` report")
    ap.add_argument("--reshard-json", type=Path, help="calibrate: a `bench reshard --json` report")
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON (- = stdout)")
    args = ap.parse_args(argv)
    if args.scenario == "rollouts":
        out, ok = _rollouts(_params(RolloutParams, args)), True
    elif args.scenario == "calibrate":
        out, ok = _calibrate(args.delta_json, args.reshard_json)
    else:
        out, ok = _paper(_params(Params, args), args.scenario), True
    if args.json:
        text = json.dumps(out, indent=2)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text)
    return 0 if ok else 1


def _params(cls: Any, args: argparse.Namespace) -> Any:
    """`cls` built from the flags; a shared flag left out takes `cls`'s own default."""
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in given.items() if v is not None})


def _paper(params: Params, scenario: str) -> dict[str, Any]:
    names = list(SCENARIOS) if scenario == "all" else [scenario]
    out = {}
    for name in names:
        start = time.monotonic()
        res = SCENARIOS[name](params)
        res["wall_s"] = round(time.monotonic() - start, 2)
        out[name] = res
        verdict = "OK" if res["ratio"] >= res["target"] else "MISSED"
        print(f"{name:10s} ratio {res['ratio']:7.2f}x  (target >= {res['target']}x) {verdict}"
              f"  [{res['wall_s']} s]")  # fmt: skip
        for key, value in res.items():
            if isinstance(value, dict):
                print("  " + key + ": " + ", ".join(f"{k} {v:.3f}" for k, v in value.items()))
    return {"params": dataclasses.asdict(params), "results": out}


def _rollouts(params: RolloutParams) -> dict[str, Any]:
    res = rollouts(params)
    for key, value in res.items():
        if isinstance(value, dict):
            print(f"{key}: " + ", ".join(f"{k} {v:.3f}" for k, v in value.items()))
        else:
            print(f"{key}: {value:.3f}")
    return {"params": dataclasses.asdict(params), "rollouts": res}


def _calibrate(delta: Path | None, reshard: Path | None) -> tuple[dict[str, Any], bool]:
    if not (delta or reshard):
        raise InvalidArgument("calibrate: give --delta-json, --reshard-json or both")
    checks = []
    if delta:
        checks += calibrate_delta(_load(delta, "delta"))
    if reshard:
        checks += calibrate_reshard(_load(reshard, "reshard"))
    for c in checks:
        verdict = "fitted" if c.fitted else "OK" if c.ok else "MISSED"
        print(f"{c.name:28s} simulated {c.simulated_s:8.3f} s  measured {c.measured_s:8.3f} s"
              f"  {c.error:+7.1%} (within {CALIBRATION:.0%}) {verdict}")  # fmt: skip
    return {"calibration": {c.name: c.to_dict() for c in checks}}, all(c.ok for c in checks)


def _load(path: Path, bench: str) -> dict[str, Any]:
    """Bench `bench`'s result in a `tensorhub bench ... --json` report (`bench all`'s too)."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise InvalidArgument(f"{path}: not a bench's JSON report ({e})") from None
    results = doc.get("results", []) if isinstance(doc, dict) else []
    found = [r for r in results if isinstance(r, dict) and r.get("bench") == bench]
    if not found or not found[0].get("details"):
        raise InvalidArgument(f"{path}: no `bench {bench}` result with details in it")
    result: dict[str, Any] = found[0]
    return result


if __name__ == "__main__":
    sys.exit(main())
