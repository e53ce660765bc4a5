"""What every CUDA graph capture of the trainer runs inside (the walk's graphs, the target's training-shape
graphs): Python's cyclic garbage collector held off.

A collection during a capture that destroys an unreachable CUDAGraph (a finished walk's, kept by a reference
cycle) makes a CUDA call the capture forbids, and the capture fails. torch.cuda.graph neither collects before
a capture (since torch 2.9) nor pauses the collector: pytorch/pytorch#161037. Seen on an H100 as a verify
capture failure that left a walk eager (docs/journal.md, session 17).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """No automatic collection while inside (an explicit gc.collect() still runs); on again after, if it
    was."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
