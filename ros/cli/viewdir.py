"""Views in `tensorhub fetch` (docs/views.md): what `tensorhub fetch --view FORMAT -o DIR`
writes beside a view's weights: config.json with the view's `quantization_config`, the key
vLLM reads to pick the FP8 method that loads the view's tensors.

The view's manifest carries the version's config files (the publisher's `metadata`) and its
own `quantization_config` (`tensorhub.view.quantization_config`). config.json, when the
view carries one, gets that config under `quantization_config`; a view that carries none
gets a config.json holding only it (a loader needs the model's own config beside it).
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from ros.cli.carry import Carried
from ros.cli.viewinfo import META_CONFIG
from ros.views.config import with_quantization_config
from tensorhub.errors import InvalidArgument, InvalidManifest

CONFIG = "config.json"


def view_config(carried: Carried, metadata: Mapping[str, str]) -> Carried:
    """`carried` with config.json holding the view's `quantization_config` when `metadata`
    (a view manifest's) has one; `carried` unchanged for a version that is no view.
    `InvalidManifest` when either is not a JSON object."""
    text = metadata.get(META_CONFIG)
    if text is None:
        return carried
    try:
        config = json.loads(text)
    except ValueError as exc:
        raise InvalidManifest(f"{META_CONFIG} is not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise InvalidManifest(f"{META_CONFIG} holds a {type(config).__name__}, not an object")
    base = carried.files.get(CONFIG, b"{}").decode("utf-8", errors="replace")
    try:
        merged = with_quantization_config(base, config)
    except InvalidArgument as exc:  # the carried config.json is no JSON object
        raise InvalidManifest(f"the view's {CONFIG}: {exc}") from None
    files = {**carried.files, CONFIG: merged.encode()}
    left = {name: size for name, size in carried.left.items() if name != CONFIG}
    return Carried(files, left)
