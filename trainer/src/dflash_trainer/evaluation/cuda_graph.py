"""One CUDA graph capture for the decode walk's forwards (the target's verify, the drafter's guesses)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import TypeVar

import torch

log = logging.getLogger(__name__)
T = TypeVar("T")


def capture(
    run: Callable[[], T], around: contextlib.AbstractContextManager[object] | None = None
) -> tuple[torch.cuda.CUDAGraph, T]:
    """Records `run` in a CUDA graph (nothing runs: each replay does) and returns the graph and `run`'s
    outputs, the graph's own tensors that every replay refreshes. `around` is entered inside the caller's
    precision, outside the capture."""
    graph = torch.cuda.CUDAGraph()
    # Autocast's cast cache must be off while capturing (torch.cuda.graph's documented restriction).
    cast = torch.autocast(
        "cuda",
        dtype=torch.get_autocast_dtype("cuda"),
        enabled=torch.is_autocast_enabled("cuda"),
        cache_enabled=False,
    )
    torch.cuda.synchronize()
    # thread_local: another thread's CUDA calls (a loader pinning memory) do not break the capture.
    with cast, around or contextlib.nullcontext(), torch.cuda.graph(graph, capture_error_mode="thread_local"):
        out = run()
    return graph, out


def try_capture(
    run: Callable[[], T],
    what: str,
    without: str,
    around: contextlib.AbstractContextManager[object] | None = None,
) -> tuple[torch.cuda.CUDAGraph, T] | None:
    """capture(), or None after a capture error (a CUDA call not allowed while capturing), said in the log:
    `what` names the forward, `without` what the walk does instead. The walk stays lossless either way."""
    try:
        return capture(run, around)
    except RuntimeError as e:
        torch.cuda.synchronize()
        log.warning(
            "decode walk: %s's CUDA graph failed to capture (%s: %s); %s", what, type(e).__name__, e, without
        )
        return None
