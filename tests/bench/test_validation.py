"""The simulator against the emulated-host benchmark at small scale: the same topology
(one trainer, 4 readers, every link at its tbf rate less Ethernet/IP/TCP framing), the same
model and chunk size; the simulated time until every reader is done must be within 25 %
of the measured one. Needs root (skipped otherwise)."""

from __future__ import annotations

import os

import pytest

from bench.common import MODEL, Options, span, verify
from bench.emu.cluster import Cluster
from bench.emu.control import broadcast
from bench.sim.scenarios import Cluster as SimCluster
from bench.sim.scenarios import Params, tensorhub_fetch

READERS = 4
PAYLOAD = 1448 / 1514  # TCP payload per Ethernet frame (tbf counts whole frames)


@pytest.mark.skipif(os.geteuid() != 0, reason="emulated hosts need root (netns, tc)")
def test_simulator_matches_the_emulated_fanout() -> None:
    opts = Options(size_mb=16)
    goodput = opts.rate_Bps * PAYLOAD  # what TCP payload can get through tbf at this rate
    p = Params(gpus=1 + READERS, gpus_per_host=1, nic_gbps=goodput * 8 / 1e9,
               model_gb=opts.nbytes / 1e9, chunk_mb=opts.chunk / 1e6)  # fmt: skip
    sim = SimCluster(p, {1: 1 + READERS})
    flows = tensorhub_fetch(sim, list(range(1, 1 + READERS)), [0], 1)
    simulated = sim.net.run()
    assert all(fs[0].done for fs in flows.values())
    with Cluster({1: 1 + READERS}, opts.rate_mbit) as c:
        # The links must be the bottleneck, not the shared CPUs: on a loaded 2-core machine
        # one ring of plain transfers can fall just short (0.845 of the rate seen once), so
        # measure up to 3 times and keep the first that saturates.
        for _ in range(3):
            sat = c.saturation(c.parts, opts.nbytes)
            if sat.saturated:
                break
        trainer, pool = c.parts[0], c.parts[1:]
        # The simulator models links, not CPUs: the shared 2-core machine can only make a
        # fetch slower than its links allow (0.98 s against 0.73 simulated once in CI, with
        # the links saturated just before). So fetch up to 3 versions and judge the fastest;
        # a fetch faster than the simulated links would still fail.
        measured: list[float] = []
        for version in range(1, 4):
            pub = trainer.call("publish", model=MODEL, version=version, nbytes=opts.nbytes,
                               seed=opts.seed + version, chunk=opts.chunk)  # fmt: skip
            got = broadcast(pool, "fetch", 120, model=MODEL, version=version)
            verify(pub["digest"], got, "readers")
            measured.append(span(got))  # the simulator models the fetch, not the publish
            if simulated == pytest.approx(min(measured), rel=0.25):
                break
    assert sat.saturated, sat.to_dict()
    assert simulated == pytest.approx(min(measured), rel=0.25), (simulated, measured)
