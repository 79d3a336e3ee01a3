"""Entry point of the demo's worker processes: `python -m ros.demo.worker trainer|rollout N`.

The settings come from the environment (`TENSORHUB_DEMO_CONFIG`, written by the driver), so
the tenant token never shows up in `ps`.
"""

from __future__ import annotations

import logging
import sys

from ros.demo.config import DemoConfig
from tensorhub.errors import TensorHubError
from tensorhub.process_exit import exit_now


def main(argv: list[str]) -> int:
    logging.basicConfig(
        level=logging.WARNING, format=f"%(levelname)s {' '.join(argv)}: %(message)s"
    )
    cfg = DemoConfig.from_env()
    try:
        if argv[:1] == ["trainer"]:
            from ros.demo.trainer import run_trainer

            return run_trainer(cfg)
        if argv[:1] == ["rollout"] and len(argv) == 2:
            from ros.demo.rollout import run_rollout

            return run_rollout(cfg, int(argv[1]))
    except TensorHubError as exc:
        print(f"{' '.join(argv)}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C reaches the whole process group; the driver cleans up
        return 130
    print("usage: python -m ros.demo.worker trainer | rollout INDEX", file=sys.stderr)
    return 2


if __name__ == "__main__":
    exit_now(main(sys.argv[1:]))
