"""Adapters between TensorHub and the frameworks RL stacks use (see docs/integrations.md).

- `ros.integrations.pytorch`: publish and fetch `state_dict`s and `nn.Module`s in place,
  tied and non-contiguous tensors included.
- `ros.integrations.vllm`: turn a fetched version into the `(name, tensor)` iterator that
  vLLM's `model.load_weights` takes, around pause/resume hooks.
- `ros.integrations.hf`: Hugging Face `transformers` models (tied embeddings, derived buffers).
"""
