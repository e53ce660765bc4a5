"""One CUDA graph capture for the decode walk's forwards (the target's verify, its rollback, the drafter's
guesses), and `Graphed`: the sequence each of them follows (eager once, captured, replayed, eager for good
after a capture error)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Generic, TypeVar

import torch

from dflash_trainer.capture_guard import collector_paused

log = logging.getLogger(__name__)
T = TypeVar("T")
Around = Callable[[], contextlib.AbstractContextManager[object]]


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
    with (
        cast,
        around or contextlib.nullcontext(),
        collector_paused(),
        torch.cuda.graph(graph, capture_error_mode="thread_local"),
    ):
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


class Graphed(Generic[T]):
    """`run` (a forward over buffers that keep their addresses) from a CUDA graph once it can be: its first
    call runs eagerly (its kernels compile and autotune, cuBLAS picks its algorithms), its second captures,
    every later one replays. After a capture error it runs eagerly for good (`failed`), said once in the log
    (`what`, `without`: try_capture's). The outputs of a replay are the graph's own tensors, refreshed by the
    next replay."""

    def __init__(self, run: Callable[[], T], what: str, without: str) -> None:
        self.run, self.what, self.without = run, what, without
        self.failed = False
        self._captured: tuple[torch.cuda.CUDAGraph, T] | None = None
        self._ran = False

    @property
    def captured(self) -> bool:
        return self._captured is not None

    def release(self) -> None:
        """Drops the graph and its outputs now (its memory pool goes back to the allocator), not at whatever
        later collection finds the cycle that holds it; the next call starts over, eagerly."""
        self._captured, self._ran = None, False

    def __call__(self, around: Around | None = None) -> T:
        """One run. `around()` is entered around an eager run and around the capture, not a replay."""
        enter = around or contextlib.nullcontext
        if self._captured is None and self._ran and not self.failed:
            self._captured = try_capture(self.run, self.what, self.without, enter())
            self.failed = self._captured is None
        if self._captured is not None:
            graph, out = self._captured
            graph.replay()
            return out
        self._ran = True
        with enter():
            return self.run()
