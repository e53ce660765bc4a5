"""This rank's CUDA memory as its log lines carry it (a leaf: the training loop and pipeline ranks use it)."""

from __future__ import annotations

import sys


def gpu_memory() -> str:
    """` gpu_mem A/R GiB`: this rank's allocated and reserved CUDA memory (the alerts' metrics read it from
    the window and step lines); "" where CUDA is not in use."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return ""
    gib = 2**30
    return f" gpu_mem {torch.cuda.memory_allocated() / gib:.2f}/{torch.cuda.memory_reserved() / gib:.2f} GiB"
