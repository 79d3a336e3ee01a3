"""Can this process use same-host CUDA IPC at all? Says why not, for the fallback reason."""

from __future__ import annotations

import sys


def ipc_unavailable_reason() -> str:
    """Why this process cannot map or share GPU memory through CUDA IPC ('' when it can)."""
    if not sys.platform.startswith("linux"):
        return f"CUDA IPC is used on Linux only (this is {sys.platform})"
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device in this process (torch.cuda.is_available() is False)"
    return ""


def ipc_available() -> bool:
    """Whether this process can serve and read versions through CUDA IPC."""
    return not ipc_unavailable_reason()
