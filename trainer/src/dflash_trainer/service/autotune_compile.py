"""An autotuned Triton kernel's candidate configs compiled at once, on threads, before the autotuner times
them.

Triton's autotuner, at a kernel's first call with a new key, compiles and times each candidate config in turn;
on a new CT that is most of the FLA probe's minute (docs/benchmarks.md, preflight). Inside
`configs_compiled_at_once`, the autotuner's `prune_configs` (called only at such a miss, after `run` has set
`nargs`) also starts every candidate's compile under triton.AsyncCompileMode: LLVM's code generation and ptxas
run without the GIL, so the compiles overlap. Its exit waits for them, and the autotuner then times
kernels that are already built. A compile that fails here is left to the timing, which reports it as Triton
always does.

The probe (service.gpu_probe) enters it when DFLASH_PROBE_COMPILE_WORKERS is 2 or more; bench_preflight's
`cold-parallel` run measures it against Triton's own order.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
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


def _compile_all(
    autotuner: Any, configs: list[Any], kwargs: dict[str, Any], pool: ThreadPoolExecutor
) -> None:
    from triton import AsyncCompileMode

    args = tuple(autotuner.nargs.values())
    with AsyncCompileMode(pool, ignore_errors=True):
        for config in configs:
            try:  # warmup=True: compile, do not launch (JITFunction.run)
                autotuner.fn.run(*args, **{**kwargs, **config.all_kwargs(), "warmup": True})
            except Exception as e:  # the timing compiles it again and reports it
                log.debug("config %s not compiled ahead: %s", config, e)


@contextlib.contextmanager
def configs_compiled_at_once(workers: int) -> Iterator[None]:
    """While inside, each autotuning miss first compiles its candidates on `workers` threads (below 2:
    Triton's own order)."""
    if workers < 2:
        yield
        return
    from triton.runtime.autotuner import Autotuner

    prune = Autotuner.prune_configs

    def prune_and_compile(self: Any, kwargs: dict[str, Any]) -> list[Any]:
        configs = prune(self, kwargs)
        if len(configs) > 1 and self.nargs:
            _compile_all(self, configs, kwargs, pool)
        return configs

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="triton-compile") as pool:
        Autotuner.prune_configs = prune_and_compile
        try:
            yield
        finally:
            Autotuner.prune_configs = prune
