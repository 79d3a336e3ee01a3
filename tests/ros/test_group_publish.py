"""`publish(..., group=PG)`: one hub call per version from a process group (issue 35, item 3),
with real process groups: 2, 3 or 8 processes in a gloo group on CPU
(tests/ros/group_rank_proc.py), each rank a real SDK client serving its own memory, the hub
and a reader in the test process.

Checked: the group's ranks make one PublishShards call and no Publish (the hub's own request
counter), the version becomes visible with the group's one call, every shard read back by a
reader equals its rank's tensors (served by that rank), a rank whose publish fails before it
has a request fails alone with its named error while the others return (nobody waits
forever in the gather) and the version stays invisible, and a DTensor state dict (FSDP2)
published through the group reads back as `get_model_state_dict(full_state_dict=True)`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

import ros
from ros.hub.server import HubServer
from ros.metrics import HUB_REQUESTS
from tests.gloo_ranks import launch
from tests.ros.group_rank_proc import tensors_of
from tests.ros.test_dtensor_publish import _check_reads


def _calls(method: str) -> float:
    return float(HUB_REQUESTS.labels(method, "OK")._value.get())


@contextmanager
def group(
    hub: HubServer, token: str, model: str, mode: str, world: int, out: Path | None = None
) -> Iterator[list[dict[str, Any]]]:
    """`world` rank processes that published `model`@1 through their group (their JSON
    lines, by rank); they serve until the block ends."""
    args = [hub.address, "team-a", token, model, mode]
    with launch("tests.ros.group_rank_proc", args, world, {"TH_OUT": str(out or "")}) as said:
        assert all("exit" not in s for s in said), said
        yield said


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
def test_a_group_publishes_its_shards_in_one_hub_call(
    world: int, hub_server: HubServer, make_tenant: Callable[[str], str]
) -> None:
    token = make_tenant("team-a")
    model = f"group-{world}"
    publishes, groups = _calls("Publish"), _calls("PublishShards")
    with group(hub_server, token, model, "plain", world) as ranks:
        assert [r.get("error") for r in ranks] == [None] * world, ranks
        assert [r["shard"] for r in ranks] == list(range(world))
        assert all(r["visible"] for r in ranks)  # one call: every shard in the last batch's reply
        assert _calls("PublishShards") - groups == 1
        assert _calls("Publish") - publishes == 0
        reader = ros.connect(hub_server.address, tenant="team-a", token=token)
        try:
            assert reader.latest(model) == 1
            for rank in range(world):
                held = reader.fetch(model, 1, shard=rank, timeout=60)
                expected = tensors_of(rank)
                assert set(held.tensors) == set(expected)
                assert all(torch.equal(held.tensors[k], v) for k, v in expected.items())
                assert held.stats.bytes_per_source  # read from a holder: its rank
                held.release(force=True)
        finally:
            reader.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_rank_that_fails_before_its_request_fails_alone_and_nobody_hangs(
    hub_server: HubServer, make_tenant: Callable[[str], str]
) -> None:
    token = make_tenant("team-a")
    with group(hub_server, token, "group-fail", "fail-one", 3) as ranks:
        assert ranks[1].get("error") == "InvalidArgument", ranks
        assert [r.get("error") for r in (ranks[0], ranks[2])] == [None, None], ranks
        assert not any(r.get("visible") for r in ranks)
        reader = ros.connect(hub_server.address, tenant="team-a", token=token)
        try:
            assert reader.latest("group-fail") == 0  # 2 of 3 shards: nothing visible
        finally:
            reader.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_fsdp2_state_dict_publishes_through_its_group(
    hub_server: HubServer, make_tenant: Callable[[str], str], tmp_path: Path
) -> None:
    """FSDP2 on 2 gloo ranks, `publish(model, 1, state_dict, group=WORLD)`: one hub call,
    and the reader's bytes are the full state dict (tests/ros/test_dtensor_publish.py)."""
    token = make_tenant("team-a")
    groups = _calls("PublishShards")
    with group(hub_server, token, "group-fsdp", "fsdp", 2, tmp_path) as ranks:
        assert [r.get("error") for r in ranks] == [None, None], ranks
        assert _calls("PublishShards") - groups == 1
        reader = ros.connect(hub_server.address, tenant="team-a", token=token)
        try:
            assert reader.latest("group-fsdp") == 1
            published = [{"shard": r["shard"], "own_memory": {"-": True}} for r in ranks]
            _check_reads(reader, "group-fsdp", tmp_path, published)
        finally:
            reader.close()
