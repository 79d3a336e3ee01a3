"""The simulator: exact single-transfer times, pipelining, and that TensorHub's choices
come from the real planner in `transport.planner`."""

from __future__ import annotations

import pytest

from bench.sim import scenarios
from bench.sim.engine import Flow, Network
from bench.sim.scenarios import Cluster, Params, tensorhub_fetch
from transport import planner


def _net(n: int, rate: float) -> tuple[Network, list[int], list[int]]:
    net = Network()
    up = [net.link(f"up{i}", rate) for i in range(n)]
    down = [net.link(f"down{i}", rate) for i in range(n)]
    return net, up, down


def test_single_transfer_takes_size_over_rate() -> None:
    net, up, down = _net(2, 125e6)
    flow = net.add(Flow((up[0], down[1]), 1e9))
    net.run()
    assert flow.done == pytest.approx(1e9 / 125e6)


def test_flows_share_a_link_fairly() -> None:
    net, up, down = _net(4, 100.0)
    flows = [net.add(Flow((up[0], down[i]), 1000)) for i in (1, 2, 3)]
    net.run()
    assert [f.done for f in flows] == pytest.approx([30.0] * 3)


def test_a_pipelined_chain_adds_one_chunk_time_per_hop() -> None:
    net, up, down = _net(4, 100.0)
    a = net.add(Flow((up[0], down[1]), 1000))
    b = net.add(Flow((up[1], down[2]), 1000, upstream=a, lag=10))
    c = net.add(Flow((up[2], down[3]), 1000, upstream=b, lag=10))
    net.run()
    assert (a.done, b.done, c.done) == pytest.approx((10.0, 10.1, 10.2))


def test_tensorhub_choices_are_the_real_planner() -> None:
    assert scenarios.pipeline_plan is planner.pipeline_plan
    assert scenarios.plan is planner.plan
    p = Params(gpus=32, gpus_per_host=8, model_gb=1.0, trainer_fraction=0.25)
    c = Cluster(p, {1: p.hosts})
    flows = tensorhub_fetch(c, [1, 2, 3], [0], 1)
    # readers registered in order form a chain behind the publisher
    assert [f.tag for fs in flows.values() for f in fs] == ["0>1", "1>2", "2>3"]
    c.net.run()
    assert flows[3][0].done == pytest.approx(p.one_transfer + 2 * p.chunk / p.nic, rel=1e-6)


@pytest.mark.parametrize("name", ["standalone", "elastic", "crossdc"])
def test_scenarios_run_at_small_scale(name: str) -> None:
    p = Params(gpus=128, joiners=4, leavers=1, model_gb=10.0)
    result = scenarios.SCENARIOS[name](p)
    assert result["ratio"] > 0
