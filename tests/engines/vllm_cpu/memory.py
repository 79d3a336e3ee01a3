"""Host memory and bytes of each vLLM worker per update at TP 2, blocks against whole
versions (issue 34): `python -m tests.engines.vllm_cpu.memory [--updates 3]
[--modes whole,blocks] [--second] [--changed 0.01]`.

A Llama of about 300 MB in fp32 (`CONFIG`: 16 query heads and one KV head, so the KV head
is replicated on both ranks; tied embeddings), a real etcd and hub started here, a trainer
here publishing `--updates` versions (each a small change of the one before, published with
its delta: every element by default, a share of them with `--changed`); per mode, a fresh
TP-2 vLLM (CPU build, `mp` executor, one core per worker) in a process of its own updates
to each version:

- `whole`: the engine's whole-version path (`"slices": False`, `"delta": True`, its
  default at TP 1): each worker reads the whole version and keeps its host copy as the next
  update's delta base;
- `blocks` (the default at TP > 1): each worker reads only its blocks, learned from vLLM's
  loaders, loads them and serves them (`ros.integrations.vllm_blocks`).

With `--second`, each mode runs a second TP-2 vLLM beside the first, which updates to each
version after the first has (its rows are `MODE-2`): in `blocks`, its workers read their
blocks from the first instance's workers while those serve them.

Per worker and update: `read`, the bytes its fetch read; `trainer`, those of them read from
the trainer; `blocks`, its blocks' bytes (the
checkpoint's, in `whole`); `kept`, what the engine keeps between updates (`held_bytes` +
`base_bytes`); `fetch`, the peak resident memory during the fetch over the resident memory
before the update (VmHWM reset through /proc/self/clear_refs); `load`, the peak during
vLLM's layerwise reload over the resident memory when it began; `peak`, the higher of the
two over the memory before the update; `growth`, the resident growth that stays
(`ros.integrations.vllm_memory.UpdateMemory`). The bound of the issue: its blocks plus
64 MiB during an update. Prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

MiB = 1024 * 1024
SLACK = 64 * MiB
TENANT = "mem"


def config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
        num_attention_heads=16, num_key_value_heads=1, head_dim=64,
        max_position_embeddings=128, tie_word_embeddings=True,
    )  # fmt: skip


def child(mode: str, hub: str, token: str, checkpoint: str, model: str, updates: int) -> None:
    """One TP-2 vLLM: update to versions 1..updates, printing each update's statuses."""
    os.environ.update(
        VLLM_ENABLE_V1_MULTIPROCESSING="1", VLLM_CPU_OMP_THREADS_BIND="0|1",
        VLLM_CPU_KVCACHE_SPACE="1",
    )  # fmt: skip
    from ros.integrations.vllm import update_vllm
    from tests.engines.vllm_cpu import tiny

    llm = tiny.start_llm(checkpoint, tp=2)
    info = {"hub": hub, "tenant": TENANT, "token": token, "model": model, "timeout": 300}
    info["slices"] = mode == "blocks"
    llm.init_weight_transfer_engine({"init_info": info})
    for version in range(1, updates + 1):
        sys.stdin.readline()  # the trainer published it
        update_vllm(llm, version)
        print(json.dumps(tiny.statuses(llm)), flush=True)
    sys.stdin.read()  # serve the last version until every instance updated to it
    llm.shutdown_weight_transfer_engine()


def run(
    mode: str, hub: str, token: str, checkpoint: str, model: str, trainer: Any,
    tensors: dict[str, torch.Tensor], updates: int, instances: int = 1, changed: float = 1.0,
) -> list[list[list[dict[str, Any]]]]:  # fmt: skip
    """`instances` vLLM processes of `mode` through `updates` versions of `model`, each
    updating after the one before it: their statuses, per instance and update."""
    argv = [sys.executable, "-m", "tests.engines.vllm_cpu.memory", "--child", mode, "--hub",
            hub, "--token", token, "--checkpoint", checkpoint, "--model", model,
            "--updates", str(updates)]  # fmt: skip
    procs = [
        subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for _ in range(instances)
    ]
    out: list[list[list[dict[str, Any]]]] = [[] for _ in procs]
    try:
        for version in range(1, updates + 1):
            g = torch.Generator().manual_seed(version)
            for t in tensors.values():
                if changed >= 1.0:
                    t.add_(1e-3)  # every element changes a little
                else:  # a share of the elements, as an RL step at a small learning rate
                    t.add_(1e-3 * (torch.rand(t.shape, generator=g) < changed).to(t.dtype))
            held = trainer.publish(model, version, tensors, delta=True)
            for proc, statuses in zip(procs, out, strict=True):
                statuses.append(_update(proc, mode))
            held.release()
    finally:
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.close()
        for proc in procs:
            proc.wait(120)
    return out


def _update(proc: subprocess.Popen[str], mode: str) -> list[dict[str, Any]]:
    """Tell one vLLM process the next version is out; its workers' statuses after it."""
    assert proc.stdin is not None
    assert proc.stdout is not None
    proc.stdin.write("go\n")
    proc.stdin.flush()
    line = ""
    while not line.startswith("["):
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{mode}: the vLLM process ended")
    return list(json.loads(line))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--updates", type=int, default=3)
    ap.add_argument("--modes", default="whole,blocks")
    ap.add_argument("--second", action="store_true", help="a second instance after the first")
    ap.add_argument("--changed", type=float, default=1.0,
                    help="share of the elements each version changes (1: every one)")  # fmt: skip
    ap.add_argument("--child")
    ap.add_argument("--hub")
    ap.add_argument("--token")
    ap.add_argument("--checkpoint")
    ap.add_argument("--model")
    args = ap.parse_args()
    if args.child:
        child(args.child, args.hub, args.token, args.checkpoint, args.model, args.updates)
        return 0
    from transformers import LlamaForCausalLM

    import ros
    from consistency import EtcdCluster, Keys
    from ros.hub.server import HubServer
    from ros.hub.tenants import TenantStore

    torch.manual_seed(0)
    figures: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp, EtcdCluster(size=1) as etcd:
        model = LlamaForCausalLM(config()).eval()
        model.save_pretrained(Path(tmp) / "v0")
        tensors = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()
                   if k != "lm_head.weight"}  # fmt: skip
        del model
        whole = sum(t.numel() * t.element_size() for t in tensors.values())
        hub = HubServer(etcd.endpoints, admin_token="admin", keys=Keys("/vllm-memory")).start()
        try:
            token = TenantStore(hub.etcd, hub.keys).create(TENANT)
            for i, mode in enumerate(args.modes.split(",")):
                name = f"trainer-{mode}"
                trainer = ros.connect(hub.address, tenant=TENANT, token=token, name=name)
                try:
                    runs = run(mode, hub.address, token, str(Path(tmp) / "v0"), f"policy-{i}",
                               trainer, tensors, args.updates, 2 if args.second else 1,
                               args.changed)  # fmt: skip
                    for n, statuses in enumerate(runs):
                        figures[mode if n == 0 else f"{mode}-{n + 1}"] = statuses
                finally:
                    trainer.close()
        finally:
            hub.stop(grace=0.2)
    print(f"checkpoint {whole / MiB:.1f} MiB")
    print(f"{'mode':8} {'upd':>3} {'rank':>4} {'read':>7} {'trainer':>7} {'blocks':>7} "
          f"{'kept':>7} "
          f"{'fetch':>7} {'load':>7} {'peak':>7} {'growth':>7} {'bound':>7}  (MiB)")  # fmt: skip
    for mode, steps in figures.items():
        for step, workers in enumerate(steps, start=1):
            for rank, w in enumerate(workers):
                mem = w["last_update_memory"]
                sources = w["last_fetch"]["bytes_per_source"]
                read = sum(sources.values())
                trained = sum(b for name, b in sources.items() if name.startswith("trainer-"))
                blocks = w.get("block_bytes", whole)
                kept = w["held_bytes"] + w["base_bytes"]
                before, load_start = mem["rss_before"], mem["rss_load_start"]
                print(f"{mode:8} {step:>3} {rank:>4} {read / MiB:7.1f} {trained / MiB:7.1f} "
                      f"{blocks / MiB:7.1f} {kept / MiB:7.1f} "
                      f"{(mem['rss_fetch_peak'] - before) / MiB:7.1f} "
                      f"{(mem['rss_load_peak'] - load_start) / MiB:7.1f} "
                      f"{(mem['rss_peak'] - before) / MiB:7.1f} "
                      f"{(mem['rss_after'] - before) / MiB:7.1f} "
                      f"{(blocks + SLACK) / MiB:7.1f}")  # fmt: skip
    boxes = figures.get("blocks", [[{}]])[0][0].get("boxes", {})
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.k_proj.weight",
                 "model.layers.0.self_attn.q_proj.weight"):  # fmt: skip
        print(f"rank 0 consumes {name}: {boxes.get(name)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
