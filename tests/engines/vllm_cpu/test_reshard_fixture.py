"""`tensorhub bench reshard`'s committed layout (bench/fixtures/vllm_llama_tp.json) is what
vLLM's own loaders give today: recorded again from this vLLM at TP 2, the layout the bench
reads in (each worker a process), and compared with the fixture, so a vLLM whose loaders
cut other blocks fails here, not silently in the benchmark. TP 4 takes 4 workers on these
2 cores: `python -m bench.reshard_layout --check` compares it too."""

from __future__ import annotations

import json

import pytest

from bench.reshard_layout import FIXTURE, parse, record


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_committed_rollout_layout_is_what_vllms_loaders_give() -> None:
    recorded = json.loads(json.dumps(record(sizes=(2,))))
    parse(recorded)
    fixture = json.loads(FIXTURE.read_text())
    assert recorded["config"] == fixture["config"]
    assert recorded["shapes"] == fixture["shapes"]
    assert recorded["layouts"]["vllm-tp2"] == fixture["layouts"]["vllm-tp2"]
