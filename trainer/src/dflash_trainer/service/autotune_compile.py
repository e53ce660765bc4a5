"""The FLA probe's autotuning: each autotuned kernel's candidate configs compiled at once on threads before
the autotuner times them, and a tally of where its seconds go.

Triton's autotuner, at a kernel's first call with a new key, compiles and times each candidate config in turn;
on a new CT that is most of the FLA probe's cold seconds (docs/benchmarks.md, preflight). Inside
`configs_compiled_at_once`, the autotuner's `prune_configs` (called only at such a miss, after `run` has set
`nargs`) also starts every candidate's compile under triton.AsyncCompileMode: LLVM's code generation and ptxas
run without the GIL, so the compiles overlap. Its exit waits for them, and the autotuner then times
kernels that are already built. A compile that fails here is left to the timing, which reports it as Triton
always does. FLA launches its kernels with keyword arguments (`kernel[grid](q=q, k=k, ...)`), so the
arguments are the autotuner's `nargs` (the positional ones) and the launch's keywords together.

`tallied` counts the candidates the autotuner times and splits their seconds into each candidate's first
call (its compile, unless compiled ahead) and the timing itself (triton.testing.do_bench's warm-up and
repetitions), so the probe's line says which of the two the cold seconds are.

The probe (service.gpu_probe) and each rank of a GPU run (service.serve, the kernels outside torch.compile)
compile at once on DFLASH_COMPILE_WORKERS threads, by default the CPUs the process may run on, shared among
the node's ranks; 0 or 1 keeps Triton's own order. bench_preflight's `cold-serial` run measures Triton's order
beside the default cold run (docs/benchmarks.md#preflight).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)
WORKERS_VARIABLE = "DFLASH_COMPILE_WORKERS"


def usable_cpus() -> int:
    """The CPUs this process may run on: the CT's cpuset and the unit's CPUAffinity, not the host's count."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def workers_from_env(env: dict[str, str] | os._Environ[str] = os.environ, ranks_here: int = 1) -> int:
    """The worker count DFLASH_COMPILE_WORKERS asks for; unset, the usable CPUs shared among the `ranks_here`
    processes of this node (0 or 1: Triton's own order, one compile after another)."""
    text = env.get(WORKERS_VARIABLE, "").strip()
    if not text:
        return usable_cpus() // max(ranks_here, 1)
    if not text.isdigit():
        raise ValueError(f"{WORKERS_VARIABLE}={text!r}: must be a whole number of threads (0 turns it off)")
    return int(text)


def rank_workers(env: dict[str, str] | os._Environ[str] = os.environ) -> int:
    """A rank's worker count: DFLASH_COMPILE_WORKERS, else its share of the node's CPUs among the
    LOCAL_WORLD_SIZE ranks the launcher started there."""
    return workers_from_env(env, int(env.get("LOCAL_WORLD_SIZE") or 1))


def for_this_rank(device: str, workers: int, tally: AutotuneTally) -> contextlib.AbstractContextManager[None]:
    """A GPU rank's autotuning misses compiled ahead on `workers` threads (`rank_workers`): the Triton kernels
    it launches outside a compiled graph (the decode walk's FLA kernels). Those inside `torch.compile` are
    tuned by inductor, not by Triton's Autotuner (an H100 rehearsal's first step compiled none ahead:
    docs/journal.md, session 19). A CPU run has no Triton kernels to tune."""
    if device == "cpu":
        return contextlib.nullcontext()
    return configs_compiled_at_once(workers, tally)


def _compile_all(autotuner: Any, configs: list[Any], kwargs: dict[str, Any], pool: ThreadPoolExecutor) -> int:
    """Compiles `configs` on `pool`; the number whose compile started."""
    from triton import AsyncCompileMode

    started = 0
    with AsyncCompileMode(pool, ignore_errors=True):
        for config in configs:
            try:  # warmup=True: compile, do not launch (JITFunction.run)
                autotuner.fn.run(**{**autotuner.nargs, **kwargs, **config.all_kwargs(), "warmup": True})
                started += 1
            except Exception as e:  # the timing compiles it again and reports it
                log.debug("config %s not compiled ahead: %s", config, e)
    return started


@dataclass
class AutotuneTally:
    """The autotuner's work in one process: candidates timed, and their seconds."""

    candidates: int = 0
    compiled_ahead: int = 0
    first_call_s: float = 0.0
    timing_s: float = 0.0
    counted: bool = True  # False where this Triton's autotuner could not be tallied

    def summary(self) -> str:
        if not self.counted:
            return "autotune not tallied (this Triton's Autotuner has no do_bench property)"
        ahead = f", {self.compiled_ahead} compiles started ahead on threads" if self.compiled_ahead else ""
        return (
            f"autotune: {self.candidates} candidates{ahead}, their first calls {self.first_call_s:.1f} s, "
            f"timing {self.timing_s:.1f} s"
        )


@contextlib.contextmanager
def tallied(tally: AutotuneTally, sync: Callable[[], None]) -> Iterator[None]:
    """While inside, every candidate the autotuner times is counted in `tally`: its first call (`sync`
    waits for the device), then the autotuner's own timing of it."""
    from triton.runtime.autotuner import Autotuner

    original = Autotuner.__dict__.get("do_bench")
    if original is None or not hasattr(original, "func"):  # not the cached_property of Triton 3.x
        tally.counted = False
        yield
        return

    def timed_bench(self: Any) -> Callable[..., Any]:
        bench = original.func(self)

        def run(kernel_call: Callable[[], None], **kwargs: Any) -> Any:
            tally.candidates += 1
            t0 = time.perf_counter()
            try:
                kernel_call()  # the autotuner's own catch sees a compile error as from its timing
                sync()
            finally:
                t1 = time.perf_counter()
                tally.first_call_s += t1 - t0
            out = bench(kernel_call, **kwargs)
            tally.timing_s += time.perf_counter() - t1
            return out

        return run

    Autotuner.do_bench = property(timed_bench)
    try:
        yield
    finally:
        Autotuner.do_bench = original


@contextlib.contextmanager
def configs_compiled_at_once(workers: int, tally: AutotuneTally | None = None) -> Iterator[None]:
    """While inside, each autotuning miss first compiles its candidates on `workers` threads (below 2:
    Triton's own order); `tally` counts the compiles started.

    With the autotune results kept on disk (TRITON_CACHE_AUTOTUNING=1, the unit's), Triton's `run` prunes
    before it looks in that cache (`check_disk_cache`, triton/runtime/autotuner.py), so the compiles start
    only when the cache has no result and the autotuner is about to time the candidates: a warm restart
    loads the one kernel it runs, not every candidate."""
    try:
        from triton.runtime.autotuner import Autotuner
    except ImportError:  # no Triton, no autotuner to help: a CUDA run without FLA kernels
        Autotuner = None
    if workers < 2 or Autotuner is None:
        yield
        return

    prune = Autotuner.prune_configs
    check: Any = getattr(Autotuner, "check_disk_cache", None)  # Triton 3.x; without it, compile at the prune
    launches: dict[int, dict[str, Any]] = {}  # autotuner -> the keywords of its launch being tuned

    def compile_ahead(autotuner: Any, configs: list[Any], kwargs: dict[str, Any]) -> None:
        if len(configs) > 1:
            started = _compile_all(autotuner, configs, kwargs, pool)
            if tally is not None:
                tally.compiled_ahead += started

    def prune_and_compile(self: Any, kwargs: dict[str, Any]) -> list[Any]:
        configs = prune(self, kwargs)
        if check is not None and getattr(self, "cache_results", False):
            launches[id(self)] = kwargs  # compiled in check_then_compile, at a miss of the disk cache
        else:
            compile_ahead(self, configs, kwargs)
        return configs

    def check_then_compile(
        self: Any, tuning_key: Any, configs: list[Any], bench_fn: Callable[[], None]
    ) -> bool:
        kwargs = launches.pop(id(self), None)

        def compiled_then_timed() -> None:
            if kwargs is not None:
                compile_ahead(self, configs, kwargs)
            bench_fn()

        return check(self, tuning_key, configs, compiled_then_timed)

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="triton-compile") as pool:
        Autotuner.prune_configs = prune_and_compile
        if check is not None:
            Autotuner.check_disk_cache = check_then_compile
        try:
            yield
        finally:
            Autotuner.prune_configs = prune
            if check is not None:
                Autotuner.check_disk_cache = check
