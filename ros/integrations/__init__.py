"""Adapters between TensorHub and the frameworks RL stacks use (see docs/integrations.md).

- `ros.integrations.pytorch`: publish and fetch `state_dict`s and `nn.Module`s in place,
  tied and non-contiguous tensors included.
- `ros.integrations.vllm`: fetch whole versions for a vLLM worker (`VersionReceiver`), and
  drive an update (`update_vllm`); `ros.integrations.vllm_engine` is vLLM's `tensorhub`
  weight-transfer engine built on it (loaded by the `vllm.general_plugins` entry point).
- `ros.integrations.hf`: Hugging Face `transformers` models (tied embeddings, derived buffers).
"""
