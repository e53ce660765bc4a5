"""Where a start's seconds go: named phases of the loading, said in one line when the process is ready.

The warm restart's goal is its first step in under 30 s after launch (docs/benchmarks.md, the GPU rehearsal's
row); a start that is not timed by phase leaves its slow part unnamed (docs/gpu-rehearsal.md). Each phase of
the start (the data's index, the target, the drafter's parts, the checkpoint) is timed where it runs; the
service's READY line lists them in order with the rest.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

_phases: list[tuple[str, float]] = []


@contextmanager
def phase(name: str) -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        _phases.append((name, time.perf_counter() - start))


def record(name: str, seconds: float) -> None:
    _phases.append((name, seconds))


def breakdown(total: float) -> str:
    """The phases so far and the rest of a start of `total` seconds: "target 1.9 s, ..., other 2.0 s"."""
    parts = [f"{name} {seconds:.1f} s" for name, seconds in _phases]
    other = total - sum(seconds for _, seconds in _phases)
    return ", ".join([*parts, f"other {max(other, 0.0):.1f} s"])
