"""Hugging Face `transformers`: publish a model, fetch it in place into another instance.

A `PreTrainedModel` is an `nn.Module`, so this is `ros.integrations.pytorch` plus what is
specific to transformers models:

- Tied embeddings (`tie_word_embeddings`, e.g. GPT-2's `lm_head.weight` and
  `transformer.wte.weight`) are one tensor: sent once, and they stay tied on the reader.
- Non-persistent buffers (rotary `inv_freq`, causal masks) are not in `state_dict()` and
  are not sent: each side derives them from the config, so both must use the same config.
- No download: the reader builds its model from the config (`AutoModelForCausalLM.
  from_config(config)`), and the weights arrive from the hub.
- Delta versions on by default, as in `ros.integrations.pytorch`: the publisher keeps one
  more copy of the model (host memory) and publishes each next version also as its changes;
  a reader fetching into the same model reads only those. `delta=False` turns it off.
"""

from __future__ import annotations

from torch import nn

from ros.client.handles import Held, Publication
from ros.client.hub import DEFAULT_FETCH_TIMEOUT, Hub
from ros.integrations.pytorch import fetch_module, publish_module


def publish_pretrained(
    hub: Hub,
    model: str,
    version: int,
    hf_model: nn.Module,
    *,
    timeout: float | None = None,
    delta: bool = True,
    base_copy: str = "host",
) -> Publication:
    """Publish a transformers model's weights, served from its own memory; `delta` (default
    True: one more copy of the model kept, in `base_copy` memory) as `publish_module`'s."""
    return publish_module(
        hub, model, version, hf_model, timeout=timeout, delta=delta, base_copy=base_copy
    )


def fetch_pretrained(
    hub: Hub,
    model: str,
    hf_model: nn.Module,
    version: int | str = "latest",
    *,
    timeout: float = DEFAULT_FETCH_TIMEOUT,
    delta: bool = True,
) -> Held:
    """Fetch `model@version` in place into `hf_model` (built from the same config), and put
    it in eval mode; release the returned `Held` before the next fetch into it. Into the
    model that holds the version before, only the changes are read (`delta=False`: whole)."""
    held = fetch_module(hub, model, hf_model, version, timeout=timeout, delta=delta)
    hf_model.eval()
    return held
