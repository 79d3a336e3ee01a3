"""`tensorhub bench reshard`'s committed layout (bench/fixtures/vllm_llama_tp.json) is what
vLLM's own loaders give today: recorded again from this vLLM at TP 2 and TP 4 (each worker
a process) and compared with the fixture, so a vLLM whose loaders cut other blocks fails
here, not silently in the benchmark."""

from __future__ import annotations

import json

import pytest

from bench.reshard_layout import FIXTURE, parse, record


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_committed_rollout_layout_is_what_vllms_loaders_give() -> None:
    recorded = record()
    parse(recorded)
    assert json.loads(json.dumps(recorded)) == json.loads(FIXTURE.read_text())
