"""`Slice`: the block of a global tensor a reader wants, in the reader's own memory.

A module of its own because the readers of slices (`ros.client.slices`) and of a layout's
blocks (`ros.client.layouts`, `ros.client.layout_cover`) all take it, and the first imports
the other two.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from transport.boxes import Box


@dataclass(frozen=True)
class Slice:
    """The block of a global tensor a reader wants: `tensor` (its extent: tensor.shape) is
    filled with the global tensor's elements from `offsets` on."""

    tensor: torch.Tensor
    offsets: Sequence[int]
    global_shape: Sequence[int]

    @property
    def box(self) -> Box:
        return Box(tuple(int(o) for o in self.offsets), tuple(self.tensor.shape))
