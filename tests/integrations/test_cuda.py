"""CUDA tensors on both sides: publish from GPU memory, fetch in place into GPU memory."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import ros
from ros.hub.server import HubServer
from ros.integrations.pytorch import fetch_module, publish_module
from tests.integrations.ipc_trainer_proc import weights

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine"),
]


def test_module_cuda_to_cuda(connect: Callable[..., ros.Hub]) -> None:
    trainer, rollout = connect(), connect()
    torch.manual_seed(0)
    source = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 64)).cuda()
    target = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 64)).cuda()
    pub = publish_module(trainer, "gpu", 1, source)
    held = fetch_module(rollout, "gpu", target, timeout=60)
    for name, tensor in source.state_dict().items():
        got = target.state_dict()[name]
        assert got.is_cuda, name
        assert torch.equal(got, tensor), name
    x = torch.randn(4, 256, device="cuda")
    assert torch.equal(target(x), source(x))
    pub.release(force=True)
    held.release(force=True)


def test_the_last_holder_of_a_cuda_version_spills_it_to_host_memory(
    connect: Callable[..., ros.Hub],
) -> None:
    """The paper's "offload to CPU": leaving the block copies the GPU tensors to host memory
    once, and the version is served from there while the GPU memory is overwritten."""
    trainer = connect()
    weights = {"w": torch.randn(1024, 256, device="cuda"), "b": torch.randn(256, device="cuda")}
    expected = {name: t.cpu() for name, t in weights.items()}
    with trainer.publish("gpu", 1, weights):
        pass
    for tensor in weights.values():
        tensor.zero_()  # the GPU memory is free: the optimizer may step
    assert trainer.spills.held_bytes == sum(t.numel() * t.element_size() for t in expected.values())
    held = connect().fetch("gpu", 1, timeout=60)
    for name, tensor in expected.items():
        assert torch.equal(held.tensors[name], tensor), name


def test_a_rollout_on_the_same_gpu_reads_a_trainer_process_over_cuda_ipc(
    connect: Callable[..., ros.Hub], make_tenant: Callable[[str], str], hub_server: HubServer
) -> None:
    """Colocated RL: trainer and rollout processes on one host and GPU. The fetch goes over
    CUDA IPC (the trainer's record advertises `ipc`), straight into the rollout's GPU
    tensors; a rollout in the trainer's own process falls back to TCP and says why."""
    token = make_tenant("team-ipc")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    trainer = subprocess.Popen(
        [sys.executable, "-m", "tests.integrations.ipc_trainer_proc", hub_server.address,
         "team-ipc", token],
        cwd=root, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert trainer.stdout is not None
        assert trainer.stdout.readline().strip() == "READY"
        rollout = connect("team-ipc")
        into = {name: torch.empty_like(t, device="cuda") for name, t in weights().items()}
        held = rollout.fetch("gpu-ipc", 1, into=into, timeout=60)
        assert set(held.stats.transports.values()) == {"ipc"}, held.stats
        assert held.stats.fallbacks == {}
        for name, t in weights().items():
            assert held.tensors[name].data_ptr() == into[name].data_ptr()  # in place
            assert torch.equal(into[name].cpu(), t), name
        held.release(force=True)
    finally:
        assert trainer.stdin is not None
        trainer.stdin.close()
        trainer.wait(timeout=30)


def test_module_cuda_deltas_by_default(connect: Callable[..., ros.Hub]) -> None:
    """The helpers' default (`delta=True`, the base copy in host memory) with the model on
    the GPU: step 2 is published as a delta against a host copy of step 1, and a rollout
    whose GPU module holds step 1 reads only the changes, ending on the trainer's bytes."""
    trainer, rollout = connect(), connect()
    torch.manual_seed(0)
    source = nn.Linear(512, 1024).to(device="cuda", dtype=torch.bfloat16)
    target = nn.Linear(512, 1024).to(device="cuda", dtype=torch.bfloat16)
    pub = publish_module(trainer, "gpu-delta", 1, source, chunk_size=64 << 10)
    held = fetch_module(rollout, "gpu-delta", target, 1, timeout=60)
    pub.release()
    held.release()
    g = torch.Generator(device="cuda").manual_seed(1)
    with torch.no_grad():
        for p in source.parameters():
            mask = torch.rand(p.shape, generator=g, device="cuda") < 0.01
            p.copy_(torch.where(mask, (p.float() * 1.01).to(p.dtype), p))
    pub = publish_module(trainer, "gpu-delta", 2, source, chunk_size=64 << 10)
    assert pub.companion is not None
    held = fetch_module(rollout, "gpu-delta", target, 2, timeout=60)
    assert held.delta is not None
    assert held.delta.chunks > 0, held.delta
    for name, tensor in source.state_dict().items():
        assert torch.equal(target.state_dict()[name], tensor), name
    pub.release(force=True)
    held.release(force=True)
