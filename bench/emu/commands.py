"""The command loop of a process an emulated benchmark drives over its stdin and stdout
(`bench.emu.participant`, `bench.fanout_ranks`): one JSON object a line each way."""

from __future__ import annotations

import json
import sys
import traceback
from collections.abc import Callable, Mapping
from typing import Any


def serve(ops: Mapping[str, Callable[..., Any]]) -> None:
    """Say ready, then answer each command (`{"op": NAME, **kwargs}`) with what `ops[NAME]`
    returns, until stdin closes. A command that raises is answered `{"error": ...}` (its
    traceback goes to stderr): the orchestrator fails the run with it."""
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        try:
            answer = ops[op](**cmd)
        except Exception as exc:
            answer = {"error": f"{op}: {type(exc).__name__}: {exc}"}
            traceback.print_exc(file=sys.stderr)
        print(json.dumps(answer), flush=True)
