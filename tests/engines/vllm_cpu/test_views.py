"""A view directory in real vLLM (CPU build, `make test-engines`; docs/views.md, "Views in
vLLM"): what `tensorhub fetch MODEL@V --view FORMAT -o DIR` writes from a tiny Llama is
parsed by vLLM's own config classes and accepted by its own weight creation and loaders.

How far vLLM goes on a CPU, asserted as it is:

- config.json: vLLM's engine config (`EngineArgs.create_engine_config`, which runs
  `ModelConfig._verify_quantization`) picks `Fp8Config` with 128x128 blocks for
  `fp8-block128` and `ModelOptMxFp8Config` for `mxfp8`, each leaving `lm_head` unquantized.
- weights: for every quantized linear weight of the directory, the quant method vLLM picks
  for it (`get_quant_method`) creates its parameters (`create_weights`): their names,
  shapes and dtypes are the directory's, and each parameter's own `weight_loader` takes the
  directory's tensor bit for bit. vLLM picks its kernel at the end of `create_weights`, after
  the parameters exist: the `mxfp8` pick fails on every CPU ("Failed to find a kernel that
  can implement the MXFP8 linear layer"), the `fp8-block128` pick needs AMX ("requires AMX
  tile support") and succeeds where the CPU has it.
- the engine (slow): `vllm.LLM` on the directory. `fp8-block128` on a CPU with AMX loads
  through the model's real loaders (fused qkv and gate_up) and generates the greedy tokens
  of the view's dequantized model in Hugging Face; without AMX it stops at the kernel
  pick. `mxfp8` stops at the kernel pick, before any weight is loaded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

import ros
from ros.cli import main
from ros.cli.carry import encode
from ros.hub.server import HubServer
from tests.engines.vllm_cpu import tiny

TENANT = "views-vllm"
MXFP8_REFUSAL = "Failed to find a kernel that can implement the MXFP8 linear layer"
AMX_REFUSAL = "requires AMX tile support"
FORMATS = ("fp8-block128", "mxfp8")
SCALES = {"fp8-block128": "weight_scale_inv", "mxfp8": "weight_scale"}


def has_amx() -> bool:
    """Whether this CPU has AMX tiles: vLLM's own test for its CPU FP8 block kernel
    (`CPUFp8BlockScaledMMKernel.is_supported`)."""
    return bool(torch.cpu._is_amx_tile_supported())


def dequantized_greedy(where: Path, fmt: str) -> list[list[int]]:
    """Hugging Face's greedy tokens (`tiny.PROMPTS`) of the tiny Llama whose weights are the
    directory's view dequantized (`ros.views.dequantize_view`, fp32)."""
    from ros.views import META_FORMAT, dequantize_view

    weights = dequantize_view(read_dir(where), {META_FORMAT: fmt}, dtype=torch.float32)
    model = tiny.model(1)
    model.load_state_dict(weights)
    with torch.no_grad():
        return [
            model.generate(torch.tensor([p]), max_new_tokens=tiny.NEW_TOKENS, do_sample=False)[
                0, len(p) :
            ].tolist()
            for p in tiny.PROMPTS
        ]


@pytest.fixture
def view_dirs(
    hub_server: HubServer, make_tenant: Callable[[str], str], tmp_path: Path
) -> Iterator[dict[str, Path]]:
    """Version 1 of the tiny Llama published with both views and its config.json, and each
    view written by `tensorhub fetch policy@1 --view FORMAT -o DIR` (the CLI, in process)."""
    token = make_tenant(TENANT)
    env = {"TENSORHUB_HUB": hub_server.address, "TENSORHUB_TENANT": TENANT,
           "TENSORHUB_TOKEN": token}  # fmt: skip
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    config = tiny.config()
    config.architectures = ["LlamaForCausalLM"]
    metadata, _ = encode({"config.json": config.to_json_string().encode()})
    dirs: dict[str, Path] = {}
    try:
        with ros.connect(hub_server.address, tenant=TENANT, token=token) as trainer:
            weights = {k: v.to(torch.bfloat16) for k, v in tiny.weights(1).items()}
            pub = trainer.publish("policy", 1, weights, metadata=metadata, views=FORMATS)
            for fmt in FORMATS:
                dirs[fmt] = tmp_path / fmt
                assert main(["fetch", "policy@1", "--view", fmt, "-o", str(dirs[fmt])]) == 0
            pub.release(force=True)
        yield dirs
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def read_dir(where: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(where / "model.safetensors"), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118


def engine_config(where: Path) -> Any:
    """vLLM's engine config for the directory, as `vllm.LLM` makes it (no engine started)."""
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=str(where), skip_tokenizer_init=True, enforce_eager=True, max_model_len=128,
        dtype="bfloat16",
    )  # fmt: skip
    return args.create_engine_config()


def created(method: Any, out: int, inp: int) -> tuple[torch.nn.Module, str | None]:
    """A module with the parameters `method.create_weights` makes for an [out, inp] linear
    layer, and the kernel refusal it raised after making them (None when it picked one)."""
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    layer = torch.nn.Module()
    try:
        method.create_weights(
            layer, inp, [out], inp, out, torch.bfloat16, weight_loader=default_weight_loader
        )
    except (ValueError, RuntimeError, NotImplementedError) as exc:
        return layer, str(exc)
    return layer, None


def loader_facts(where: Path) -> dict[str, Any]:
    """What vLLM makes of the view directory `where` without starting an engine (run in a
    process of its own by the test below, as vLLM's tensor-parallel group of one is
    process-wide state): the quant config it parsed, and for each quantized linear weight of
    the directory the parameters its quant method creates, set by their own loaders."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.layers.linear import ReplicatedLinear, UnquantizedLinearMethod
    from vllm.utils.network_utils import get_open_port

    tensors = read_dir(where)
    vllm_config = engine_config(where)
    quant = vllm_config.quant_config
    facts: dict[str, Any] = {
        "config": type(quant).__name__,
        "method": vllm_config.model_config.quantization,
        "block": getattr(quant, "weight_block_size", None),
        "modules": {},
    }
    quantized = sorted(n[: -len(".weight")] for n, t in tensors.items()
                       if t.dtype == torch.float8_e4m3fn)  # fmt: skip
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(
            world_size=1, rank=0, local_rank=0, backend="gloo",
            distributed_init_method=f"tcp://127.0.0.1:{get_open_port()}",
        )  # fmt: skip
        initialize_model_parallel(1, 1)
        # what `get_quant_method` asks of a layer is its class and its prefix
        probe = ReplicatedLinear(128, 128, bias=False, quant_config=None, prefix="probe")
        head = quant.get_quant_method(probe, "lm_head")
        facts["lm_head"] = None if head is None else type(head).__name__
        for module in quantized:
            method = quant.get_quant_method(probe, module)
            out, inp = tensors[module + ".weight"].shape
            layer, refusal = created(method, out, inp)
            params: dict[str, Any] = {}
            for name, param in layer.named_parameters():
                got = tensors.get(f"{module}.{name}")
                same = got is not None and (param.shape, param.dtype) == (got.shape, got.dtype)
                if same:
                    param.weight_loader(param, got)  # type: ignore[attr-defined]
                loaded = same and torch.equal(param.data.view(torch.uint8), got.view(torch.uint8))
                params[name] = {"shape": list(param.shape), "dtype": str(param.dtype),
                                "same": same, "loaded": loaded}  # fmt: skip
            facts["modules"][module] = {
                "method": type(method).__name__,
                "unquantized": isinstance(method, UnquantizedLinearMethod),
                "params": params,
                "refusal": refusal,
            }
    return facts


@pytest.mark.slow
@pytest.mark.parametrize("fmt", FORMATS)
def test_vllm_parses_the_view_config_and_its_loaders_take_the_view_tensors(
    view_dirs: dict[str, Path], fmt: str
) -> None:
    where = view_dirs[fmt]
    tensors = read_dir(where)
    run = subprocess.run(
        [sys.executable, "-m", "tests.engines.vllm_cpu.test_views", "loaders", str(where)],
        check=False, capture_output=True, text=True, timeout=240,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )  # fmt: skip
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    line = next(x for x in run.stdout.splitlines() if x.startswith("FACTS "))
    facts = json.loads(line.removeprefix("FACTS "))
    if fmt == "fp8-block128":
        assert (facts["config"], facts["method"], facts["block"]) == (
            "Fp8Config",
            "fp8",
            [128, 128],
        )
    else:
        assert (facts["config"], facts["method"]) == ("ModelOptMxFp8Config", "modelopt_mxfp8")
    assert facts["lm_head"] in (None, "UnquantizedLinearMethod")  # lm_head stays bf16
    assert tensors["lm_head.weight"].dtype == torch.bfloat16
    modules = facts["modules"]
    assert len(modules) == 14  # 7 linear layers in each of 2 decoder layers
    for module, seen in modules.items():
        assert not seen["unquantized"], module
        assert sorted(seen["params"]) == ["weight", SCALES[fmt]], module
        for name, param in seen["params"].items():
            got = tensors[f"{module}.{name}"]
            assert param["shape"] == list(got.shape), f"{module}.{name}"
            assert param["dtype"] == str(got.dtype), f"{module}.{name}"
            assert param["loaded"], f"{module}.{name}: its loader did not take it bit for bit"
    refusals = {seen["refusal"] for seen in modules.values()}
    if fmt == "mxfp8":
        assert len(refusals) == 1
        assert MXFP8_REFUSAL in str(next(iter(refusals)))
    elif has_amx():
        assert refusals == {None}  # a kernel picked: the engine test loads and runs it
    else:
        assert len(refusals) == 1
        assert AMX_REFUSAL in str(next(iter(refusals)))


def start_engine(where: str) -> None:
    """Start `vllm.LLM` on a view directory in this process and generate; prints one line
    `GENERATED <json>` or raises what vLLM raised (run as a script by the test below)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM

    llm = LLM(model=where, skip_tokenizer_init=True, enforce_eager=True, max_model_len=128,
              dtype="bfloat16")  # fmt: skip
    print("GENERATED " + json.dumps(tiny.vllm_greedy(llm)), flush=True)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", FORMATS)
def test_vllm_starts_on_a_view_directory_as_far_as_this_cpu_goes(
    view_dirs: dict[str, Path], fmt: str
) -> None:
    """`vllm.LLM` on the directory, in a process of its own (a failed start leaves vLLM's
    process state behind): how far it gets, asserted (module docstring)."""
    run = subprocess.run(
        [sys.executable, "-m", "tests.engines.vllm_cpu.test_views", "engine", str(view_dirs[fmt])],
        check=False, capture_output=True, text=True, timeout=240,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )  # fmt: skip
    said = run.stdout + run.stderr
    if fmt == "fp8-block128" and has_amx():
        assert run.returncode == 0, said[-3000:]
        line = next(x for x in run.stdout.splitlines() if x.startswith("GENERATED "))
        tokens = json.loads(line.removeprefix("GENERATED "))
        # vLLM's W8A16 kernel (bf16 activations, the view's fp8 weights and scales) gives
        # the greedy tokens of the model the view stands for
        assert tokens == dequantized_greedy(view_dirs[fmt], fmt)
    else:
        assert run.returncode != 0
        assert (MXFP8_REFUSAL if fmt == "mxfp8" else AMX_REFUSAL) in said, said[-3000:]
        assert "Loading safetensors checkpoint shards" not in said  # stopped before loading


if __name__ == "__main__":
    if sys.argv[1] == "loaders":
        print("FACTS " + json.dumps(loader_facts(Path(sys.argv[2]))), flush=True)
    else:
        start_engine(sys.argv[2])
