"""Kernel-candidate timing in turns between the processes of one machine.

On a cold start the rank compiles its drafter while the GPU probes run beside it (train.loop: the drafter's
first step compiled ahead; service.probes_beside). Both then autotune on the same GPU: the probe times FLA's
candidates (Triton's `Autotuner._bench`), the rank inductor's (`CachingAutotuner.benchmark_all_configs`).
Two CUDA contexts on one GPU run in time slices, so each would time some of the other's kernels as its own
and could keep the worse candidate: on disk, for every later start (TRITON_CACHE_AUTOTUNING, inductor's
kept best configs). Inside `in_turns(path)`, each such timing holds an exclusive flock on `path`, which
every process of the CT opens alike, and waits while another process times.

A turn is one candidate's timing (Triton) or one kernel's candidates (inductor): a fraction of a second, so
neither process waits long, and a process with nothing else timing takes an unheld lock (a system call).
What a turn does not exclude is the other process's ordinary kernels, which run between its own timings.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_trainer.service import probe_cache

log = logging.getLogger(__name__)

LOCK_NAME = "gpu-timing.lock"


def lock_path() -> Path:
    """The lock beside the probes' verdict file: the unit's cache directory, the same for the ranks and the
    probes they start."""
    return probe_cache.cache_path().with_name(LOCK_NAME)


@dataclass
class Turns:
    """One process's side of the lock: re-entrant across its threads, with the seconds it waited."""

    fd: int
    waited_s: float = 0.0
    turns: int = 0
    _depth: int = 0
    _mutex: threading.RLock = field(default_factory=threading.RLock)

    def summary(self) -> str:
        return f"kernel timings in {self.turns} turns, {self.waited_s:.1f} s waiting for another process's"

    @contextlib.contextmanager
    def turn(self) -> Iterator[None]:
        with self._mutex:
            if self._depth == 0:
                start = time.monotonic()
                fcntl.flock(self.fd, fcntl.LOCK_EX)
                self.waited_s += time.monotonic() - start
                self.turns += 1
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
                if self._depth == 0:
                    fcntl.flock(self.fd, fcntl.LOCK_UN)


def _timing_methods() -> list[tuple[type, str]]:
    """(class, method) of each timing of candidates this process can import, where the class defines it."""
    found: list[tuple[type, str]] = []
    try:
        from triton.runtime.autotuner import Autotuner

        if "_bench" in Autotuner.__dict__:
            found.append((Autotuner, "_bench"))
    except ImportError:
        pass
    try:
        from torch._inductor.runtime.triton_heuristics import CachingAutotuner

        if "benchmark_all_configs" in CachingAutotuner.__dict__:
            found.append((CachingAutotuner, "benchmark_all_configs"))
    except ImportError:
        pass
    return found


def _in_turn(turns: Turns, method: Callable[..., Any]) -> Callable[..., Any]:
    def timed_in_turn(self: Any, *args: Any, **kwargs: Any) -> Any:
        with turns.turn():
            return method(self, *args, **kwargs)

    return timed_in_turn


@contextlib.contextmanager
def in_turns(path: Path | None = None) -> Iterator[Turns | None]:
    """While inside, this process's candidate timings take turns with other processes' on `path` (default
    `lock_path()`). Yields the Turns (its `waited_s`), or None where the lock cannot be opened: then the
    timings run as before, said once in the log."""
    path = path or lock_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as e:
        log.warning("kernel timings do not take turns with other processes: %s: %s", path, e.strerror or e)
        yield None
        return
    turns = Turns(fd)
    patched = [(cls, name, cls.__dict__[name]) for cls, name in _timing_methods()]
    for cls, name, method in patched:
        setattr(cls, name, _in_turn(turns, method))
    try:
        yield turns
    finally:
        for cls, name, method in patched:
            setattr(cls, name, method)
        os.close(fd)
