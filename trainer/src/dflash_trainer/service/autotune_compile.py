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

The probe (service.gpu_probe) compiles at once when DFLASH_PROBE_COMPILE_WORKERS is 2 or more;
bench_preflight's `cold-parallel` run measures it against Triton's own order.
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
WORKERS_VARIABLE = "DFLASH_PROBE_COMPILE_WORKERS"


def workers_from_env(env: dict[str, str] | os._Environ[str] = os.environ) -> int:
    """The worker count DFLASH_PROBE_COMPILE_WORKERS asks for (0 when unset: Triton's own order)."""
    text = env.get(WORKERS_VARIABLE, "").strip()
    if not text:
        return 0
    if not text.isdigit():
        raise ValueError(f"{WORKERS_VARIABLE}={text!r}: must be a whole number of threads (0 turns it off)")
    return int(text)


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
    Triton's own order); `tally` counts the compiles started."""
    if workers < 2:
        yield
        return
    from triton.runtime.autotuner import Autotuner

    prune = Autotuner.prune_configs

    def prune_and_compile(self: Any, kwargs: dict[str, Any]) -> list[Any]:
        configs = prune(self, kwargs)
        if len(configs) > 1:
            started = _compile_all(self, configs, kwargs, pool)
            if tally is not None:
                tally.compiled_ahead += started
        return configs

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="triton-compile") as pool:
        Autotuner.prune_configs = prune_and_compile
        try:
            yield
        finally:
            Autotuner.prune_configs = prune
