"""Delta versions through the `tensorhub` engine in a real vLLM (CPU build): the worker keeps
the host copy of the version it loaded (`delta`, on by default) and fetches the next into
it, so a version the trainer published with `delta=True` moves only its changes; with
`"delta": False` in the init info nothing is kept and every version is read whole. A version
published as shards (TP-2 trainer ranks) is read with `fetch_slices(delta=True)`, whose
staging copies of the shards the SDK keeps as the base.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

import ros
from ros.hub.server import HubServer
from ros.integrations import vllm_engine
from ros.integrations.vllm import update_vllm
from ros.integrations.vllm_worker import DIGEST, weights_digest
from tests.engines.vllm_cpu import tiny

TENANT = "team-a"
MODEL = "policy"
CHUNK = 64 * 1024  # ~1.6 MB model: 25 chunks, most of them untouched by a 1 % step


def nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def same_bytes(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k].contiguous().view(torch.uint8), b[k].contiguous().view(torch.uint8))
        for k in a
    )


def nudged(weights: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """The next version: 1 % of the elements change a little (an RL step's size)."""
    g = torch.Generator().manual_seed(seed)
    return {
        name: torch.where(torch.rand(t.shape, generator=g) < 0.01, t * 1.01, t).contiguous()
        for name, t in weights.items()
    }


def hf_greedy(weights: dict[str, torch.Tensor]) -> list[list[int]]:
    model = LlamaForCausalLM(tiny.config()).eval()
    model.load_state_dict(weights)
    with torch.no_grad():
        return [
            model.generate(torch.tensor([p]), max_new_tokens=tiny.NEW_TOKENS, do_sample=False)[
                0, len(p) :
            ].tolist()
            for p in tiny.PROMPTS
        ]


@pytest.mark.timeout(240)
def test_second_update_reads_the_delta_and_delta_false_reads_whole(
    hub_server: HubServer, make_tenant: Callable[[str], str], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # one process: the short way
    token = make_tenant(TENANT)
    trainer = ros.connect(hub_server.address, tenant=TENANT, token=token, name="trainer")
    info = {"hub": hub_server.address, "tenant": TENANT, "token": token, "model": MODEL}
    try:
        llm = tiny.start_llm(tiny.save(0, tmp_path / "v0"))
        llm.init_weight_transfer_engine({"init_info": info})  # delta on: the default
        weights = tiny.weights(1)
        full = sum(t.numel() * t.element_size() for t in weights.values())
        trainer.publish(MODEL, 1, weights, chunk_size=CHUNK, delta=True)
        update_vllm(llm, 1)
        status = tiny.status(llm)
        assert status["last_delta"] is None  # nothing to apply it to yet: read whole
        assert status["base_bytes"] == full  # the cost: one host copy, kept between updates
        assert status["held_bytes"] == 0  # released: not served (serve is off)

        weights = nudged(weights, seed=2)
        assert trainer.publish(MODEL, 2, weights, chunk_size=CHUNK, delta=True).companion
        update_vllm(llm, 2)
        status = tiny.status(llm)
        delta = status["last_delta"]
        print(f"v2 by delta: {delta}; whole chunks read: {status['last_fetch']['chunks']}")
        assert delta is not None
        assert delta["base"] == 1
        assert delta["chunks"] > 0
        assert delta["base_mismatch"] == 0
        moved = delta["encoded_bytes"] + sum(status["last_fetch"]["bytes_per_source"].values())
        assert moved < full / 2
        [loaded] = llm.collective_rpc(DIGEST)
        assert loaded == {"version": 2, "digest": weights_digest(weights)}  # exact bytes
        assert tiny.vllm_greedy(llm) == hf_greedy(weights)

        # the switch: no copy kept, every version read whole
        llm.init_weight_transfer_engine({"init_info": {**info, "delta": False}})
        for version in (3, 4):
            weights = nudged(weights, seed=version)
            trainer.publish(MODEL, version, weights, chunk_size=CHUNK, delta=True)
            update_vllm(llm, version)
            status = tiny.status(llm)
            assert status["last_delta"] is None
            assert sum(status["last_fetch"]["bytes_per_source"].values()) == full
            assert status["base_bytes"] == 0
        assert llm.collective_rpc(DIGEST) == [{"version": 4, "digest": None}]  # nothing kept
        assert tiny.vllm_greedy(llm) == hf_greedy(weights)
        llm.shutdown_weight_transfer_engine()
    finally:
        trainer.close()


@pytest.mark.timeout(240)
def test_a_version_published_as_shards_updates_by_its_deltas_and_delta_false_reads_whole(
    hub_server: HubServer, make_tenant: Callable[[str], str], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # one process: load_weights is seen
    loaded: list[dict[str, torch.Tensor]] = []  # what each update handed model.load_weights
    load = vllm_engine.load_weights

    def seen(model: object, weights: list[tuple[str, torch.Tensor]]) -> None:
        loaded.append(dict(weights))  # new memory each update: nothing overwrites it
        load(model, weights)

    monkeypatch.setattr(vllm_engine, "load_weights", seen)
    token = make_tenant(TENANT)
    ranks = [
        ros.connect(hub_server.address, tenant=TENANT, token=token, name=f"rank{r}")
        for r in range(2)
    ]
    info = {"hub": hub_server.address, "tenant": TENANT, "token": token, "model": MODEL}

    def publish(version: int, weights: dict[str, torch.Tensor]) -> int:
        """TP-2 trainer ranks publish their shards; the bytes of the two shards."""
        total = 0
        for rank, client in enumerate(ranks):
            own, placements = tiny.tp2_halves(weights, rank)
            client.publish(
                MODEL, version, own, shard=(rank, 2), placements=placements,
                chunk_size=CHUNK, delta=True,
            )  # fmt: skip
            total += nbytes(own)
        return total

    try:
        llm = tiny.start_llm(tiny.save(0, tmp_path / "v0"))
        llm.init_weight_transfer_engine({"init_info": info})  # delta on: the default
        weights = tiny.weights(1)
        full = nbytes(weights)
        shards = publish(1, weights)
        update_vllm(llm, 1)
        status = tiny.status(llm)
        assert status["last_delta"] is None  # nothing to apply it to yet: read whole
        # the cost: one host copy of each source shard (the replicated tensors twice)
        assert status["base_bytes"] == shards > full
        assert same_bytes(loaded[-1], weights)

        weights = nudged(weights, seed=2)
        publish(2, weights)
        update_vllm(llm, 2)
        status = tiny.status(llm)
        delta = status["last_delta"]
        read = sum(status["last_fetch"]["bytes_per_source"].values())
        print(f"sharded v2 by delta: {delta}; read whole: {read} bytes of {full}")
        assert delta is not None
        assert delta["base"] == 1
        assert delta["chunks"] > 0
        assert delta["base_mismatch"] == 0
        assert delta["encoded_bytes"] + read < full / 2
        assert status["base_bytes"] == shards
        assert same_bytes(loaded[-1], weights)  # the trainer's exact bytes went in
        assert tiny.vllm_greedy(llm) == hf_greedy(weights)

        # the switch: the old receiver's staging copies go with it, the next reads whole
        llm.init_weight_transfer_engine({"init_info": {**info, "delta": False}})
        weights = nudged(weights, seed=3)
        publish(3, weights)
        update_vllm(llm, 3)
        status = tiny.status(llm)
        assert status["last_delta"] is None
        assert sum(status["last_fetch"]["bytes_per_source"].values()) >= full
        assert status["base_bytes"] == 0
        assert same_bytes(loaded[-1], weights)
        llm.shutdown_weight_transfer_engine()
    finally:
        for client in ranks:
            client.close()
