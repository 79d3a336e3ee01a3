"""A trainer process for the holder-death tests: actor rank 0 of a verl update, driving the
`tensorhub` backend (taken from verl's registry by name) on a tiny Llama, its holder slowed
so that a test can SIGKILL it while a reader is mid-fetch.

usage: python -m tests.engines.verl.publisher HUB TENANT TOKEN MODEL HOST
(HOST: its topology's host, in dc1/r1, so a test can put readers near it or not)
then, on stdin, one line per version: `publish SEED DELAY` (step the weights with SEED, then
serve every chunk after DELAY seconds); each answers `published VERSION DIGESTS-JSON`.
"""

from __future__ import annotations

import asyncio
import json
import sys

from verl.checkpoint_engine import CheckpointEngineRegistry
from verl.utils.import_utils import import_external_libs

import ros
from chaos.holder_faults import Fault
from ros.client.hooks import ClientHooks
from tests.engines.verl import tiny


def main() -> None:
    hub, tenant, token, model, host = sys.argv[1:6]
    import_external_libs("ros.integrations.verl")
    fault = Fault()
    topology = {"dc": "dc1", "rack": "r1", "host": host}
    client = ros.connect(
        hub, tenant=tenant, token=token, topology=topology, hooks=ClientHooks(send=fault)
    )
    engine = CheckpointEngineRegistry.new(
        "tensorhub", bucket_size=1 << 20, is_master=True, model=model, client=client
    )
    weights = tiny.build(tiny.LARGE, seed=1)
    for line in sys.stdin:
        command, seed, delay = line.split()
        assert command == "publish", line
        tiny.step(weights, int(seed))
        fault.chunk_delay = 0.0
        actor, _ = type(engine).build_topology(1, 0, [engine.prepare()])
        engine.init_process_group(**{key: values[0] for key, values in actor.items()})
        asyncio.run(engine.send_weights(tiny.per_tensor(weights)))
        engine.finalize()
        fault.chunk_delay = float(delay)
        sent = tiny.digests(dict(tiny.per_tensor(weights)))
        print("published", engine.last_version, json.dumps(sent), flush=True)


if __name__ == "__main__":
    main()
