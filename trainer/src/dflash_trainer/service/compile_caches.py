"""Whether a start found its compile caches warm: said in the journal once per start, after the first step.

The unit keeps Triton's kernels and autotune results (TRITON_CACHE_DIR, TRITON_CACHE_AUTOTUNING=1) and
inductor's graphs (TORCHINDUCTOR_CACHE_DIR) in its CacheDirectory=, which survives restarts and reboots of
the CT. A warm start adds no file there in its first step and inductor reports FX graph cache hits; a cold
one compiles, and the line says how much, so a slow first step is explained where it is read.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

CACHE_VARIABLES = {"triton": "TRITON_CACHE_DIR", "inductor": "TORCHINDUCTOR_CACHE_DIR"}


def count_files(directory: Path) -> int:
    try:
        return sum(len(files) for _root, _dirs, files in os.walk(directory))
    except OSError:
        return 0


@dataclass(frozen=True)
class CacheCounts:
    files: dict[str, int]  # cache name -> files under its directory
    graph_hits: int
    graph_misses: int
    # torch.compile's own clock in this process: frames compiled, their seconds, inductor's share of them
    frames: int = 0
    compile_s: float = 0.0
    inductor_s: float = 0.0


def directories(env: dict[str, str] | os._Environ = os.environ) -> dict[str, Path]:
    return {name: Path(env[var]) for name, var in CACHE_VARIABLES.items() if env.get(var)}


def file_counts(env: dict[str, str] | os._Environ = os.environ) -> dict[str, int]:
    """Files under each configured cache directory (preflight's caches line, the first step's snapshot)."""
    return {name: count_files(path) for name, path in directories(env).items()}


def snapshot(env: dict[str, str] | os._Environ = os.environ) -> CacheCounts:
    hits = misses = frames = 0
    compile_s = inductor_s = 0.0
    try:
        from torch._dynamo.utils import compilation_time_metrics, counters

        hits = int(counters["inductor"]["fxgraph_cache_hit"])
        misses = int(counters["inductor"]["fxgraph_cache_miss"])
        # dynamo_timed records one entry per frame dynamo compiled (backend included) and per inductor call
        compiled = compilation_time_metrics.get("_compile.compile_inner", [])
        frames, compile_s = len(compiled), float(sum(compiled))
        inductor_s = float(sum(compilation_time_metrics.get("compile_fx_inner", [])))
    except Exception:  # counters are torch internals: without them the file counts still tell
        pass
    return CacheCounts(file_counts(env), hits, misses, frames, compile_s, inductor_s)


def report(before: CacheCounts, after: CacheCounts, autotune_kept: bool) -> str:
    """One line: what the first step added to each cache, and the verdict (warm, cold, partly, or nothing)."""
    if not before.files:
        return "compile caches: none configured (TRITON_CACHE_DIR, TORCHINDUCTOR_CACHE_DIR unset)"
    added = {n: after.files.get(n, 0) - before.files.get(n, 0) for n in before.files}
    hits, misses = after.graph_hits - before.graph_hits, after.graph_misses - before.graph_misses
    parts = [f"{name} +{added[name]} files ({after.files.get(name, 0)} kept)" for name in sorted(added)]
    parts.append(f"inductor FX graph cache {hits} hits, {misses} misses")
    frames = after.frames - before.frames
    if frames:  # where a slow first step's seconds went, beside what the caches gained
        parts.append(
            f"torch.compile {after.compile_s - before.compile_s:.1f} s in {frames} frames, inductor "
            f"{after.inductor_s - before.inductor_s:.1f} s of it"
        )
    if not any(after.files.values()) and not (hits or misses or frames):  # a CPU run without train.compile
        verdict = "nothing compiled: the first step ran no torch.compile graph and no Triton kernel"
    elif not any(added.values()) and not misses:
        verdict = "warm: every kernel and graph came from the cache"
    elif not any(before.files.values()):
        verdict = "cold: empty caches, the first step compiled everything"
    else:
        verdict = "partly warm: the first step compiled what the caches lacked"
    if not autotune_kept:
        verdict += "; autotune results are not kept (TRITON_CACHE_AUTOTUNING unset)"
    return f"compile caches after the first step: {verdict} ({'; '.join(parts)})"
