"""`tensorhub bench sim [standalone|elastic|crossdc|all] [--gpus N ...]`: the simulator.

Every field of `bench.sim.scenarios.Params` is a flag (`--gpus`, `--nic-gbps`,
`--model-gb`, `--chunk-mb`, `--wan-gbps`, `--joiners`, `--arrival-window-s`, ...).
Prints each scenario's figures and its ratio against the best baseline with the target.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from bench.sim.scenarios import SCENARIOS, Params


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tensorhub bench sim", description=__doc__)
    ap.add_argument("scenario", nargs="?", default="all", choices=[*SCENARIOS, "all"])
    for f in dataclasses.fields(Params):
        ap.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON (- = stdout)")
    args = ap.parse_args(argv)
    params = Params(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Params)})
    names = list(SCENARIOS) if args.scenario == "all" else [args.scenario]
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
    if args.json:
        text = json.dumps({"params": dataclasses.asdict(params), "results": out}, indent=2)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
