"""A method TensorHub adds to every vLLM worker, so `llm.collective_rpc` can ask it by name.

`collective_rpc` with a function pickles the function to vLLM's engine process, which vLLM
refuses unless `VLLM_ALLOW_INSECURE_SERIALIZATION=1` (unpickling from a socket runs code); a
method name travels as a plain string, in every mode. vLLM mixes this class into its worker
class when the `LLM` names it:

    llm = LLM(model=path, weight_transfer_config={"backend": "tensorhub"},
              worker_extension_cls=WORKER_EXTENSION)
    llm.collective_rpc(STATUS)   # one dict per worker

The answer is plain data (numbers, strings, dicts of them): vLLM hands a worker's result back
to its client without type information unless insecure serialization is on, so a dataclass
would arrive as a dict anyway.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from ros.integrations.vllm_engine import TensorHubWeightTransferEngine
from tensorhub.errors import EngineNotReady
from transport.outcome import FetchStats

WORKER_EXTENSION = f"{__name__}.TensorHubWorkerExtension"
STATUS = "tensorhub_status"  # the method's name, for `collective_rpc`


class TensorHubWorkerExtension:
    """Mixed into vLLM's worker class by vLLM (`worker_extension_cls`): `self` is a worker.

    Its one method is prefixed, since vLLM refuses an extension whose names the worker has.
    """

    def tensorhub_status(self) -> dict[str, Any]:
        """This worker's TensorHub engine: the worker's process id (which process runs it),
        the version its model runs, the bytes of checkpoint copies it holds (`serve`), and
        what its last fetch read and from whom (`FetchStats` as a dict; None before one).

        `EngineNotReady` if the worker's weight-transfer engine is not TensorHub's."""
        engine = getattr(self, "weight_transfer_engine", None)
        if not isinstance(engine, TensorHubWeightTransferEngine):
            raise EngineNotReady(
                f"the worker's weight-transfer engine is {type(engine).__name__}, not "
                "tensorhub: start the LLM with weight_transfer_config={'backend': 'tensorhub'}"
            )
        receiver = engine.receiver
        stats = None if receiver is None else receiver.last_stats
        return {
            "pid": os.getpid(),
            "version": engine.version,
            "held_bytes": 0 if receiver is None else receiver.held_bytes,
            "last_fetch": None if stats is None else _plain(stats),
        }


def _plain(stats: FetchStats) -> dict[str, Any]:
    """A `FetchStats` as the plain dict that crosses vLLM's processes (its `touched` set of
    chunk indices, bookkeeping of the fetch, left out)."""
    return {
        f.name: getattr(stats, f.name) for f in dataclasses.fields(stats) if f.name != "touched"
    }
