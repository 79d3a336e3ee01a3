"""What `tensorhub inspect` says of a view (docs/views.md), read from its manifest's
metadata alone: no torch, so `inspect` starts as fast as the other queries."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

META_FORMAT = "tensorhub.view"  # `ros.views.META_FORMAT`
META_CONFIG = "tensorhub.view.quantization_config"  # `ros.views.META_CONFIG`
META_QUANTIZED = "tensorhub.view.quantized"  # `ros.views.META_QUANTIZED`
VIEW_OF = "tensorhub.view-of"  # `ros.client.view_publish.VIEW_OF`


def view_summary(model: str, manifest: Any) -> dict[str, Any] | None:
    """What `inspect` says of a view (None for a version that is no view): its format,
    the model it is a view of, and how many modules it quantized, from its manifest."""
    metadata = manifest.metadata
    if META_FORMAT not in metadata:
        return None
    try:
        quantized = json.loads(metadata.get(META_QUANTIZED, "{}"))
        modules = sum(int(n) for n in quantized.values()) if isinstance(quantized, dict) else 0
    except (ValueError, TypeError):
        modules = 0
    return {
        "format": metadata[META_FORMAT],
        "of": metadata.get(VIEW_OF, model),
        "quantized_modules": modules,
    }


def view_line(view: Mapping[str, Any], version: int) -> str:
    """`inspect`'s line for a view."""
    return (
        f"view {view['format']} of {view['of']}@{version}: "
        f"{view['quantized_modules']} modules quantized"
    )
