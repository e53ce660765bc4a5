"""The decode walk at a target's shape: time per verify step, where it goes, and a profile of a few steps.

    python trainer/bench/bench_walk.py --target /dev/shm/dflash/model [--shape qwen3.6-27b] [--prompts 2]
        [--new-tokens 32] [--prompt-len 256] [--profile 4] [--out walk.json]

Writes the random target of `--shape` into `--target` when no complete one is there (the rehearsal's
`dflash-train model random`), loads it whole through the trainer's own `load_target(full=True)`, builds the
reference configuration's drafter at random (tau about 1: every block rejected, the walk's worst case) and
runs the trainer's own `decode_walk`: a warm-up prompt, then the timed prompts, once per `--variants` entry
(CACHE/ROLLBACK[/DRAFT][+kept]: graph/recorded is the default walk, graph/recorded+kept the same walk with
the cache, drafter runner and graphs kept from the walk before, as the trainer's later evaluations walk,
graph/recorded/dynamic the default walk with the eager drafter, dynamic/recorded the eager walk before all)
side by side in one process; a kept variant also says the GPU memory it keeps between walks. The phases
(draft, prefill, verify, rollback) are timed with a device synchronisation around each; `--profile N` records
N more verify steps of the first variant with torch.profiler and prints the operators by device and host
time. Figures, no assertions.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, get_args

import torch

from dflash_trainer.config import load_config, read_target_info, validate
from dflash_trainer.evaluation import draft_runner, target_cache, walk
from dflash_trainer.model.target import load_target
from dflash_trainer.runtime import autocast
from dflash_trainer.train.setup import build_drafter
from dflash_trainer.train.target_side import training_capture

REFERENCE = Path(__file__).resolve().parents[1] / "configs" / "reference.toml"


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@contextmanager
def phase_timers(calls: dict[str, list[float]]) -> Iterator[None]:
    """Wraps the walk's phases with synchronised timers (restored on exit)."""
    cache = target_cache.TargetCache
    methods = ("prefill", "verify", "rollback", "snapshot")
    originals: dict[str, Any] = {name: getattr(cache, name) for name in methods}
    guesses = draft_runner.DraftRunner.guesses

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            sync()
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            sync()
            calls[name].append(time.perf_counter() - t0)
            return out

        return run

    draft_runner.DraftRunner.guesses = timed("draft", guesses)  # type: ignore[method-assign]
    for name in methods:
        setattr(cache, name, timed(name, originals[name]))
    try:
        yield
    finally:
        draft_runner.DraftRunner.guesses = guesses  # type: ignore[method-assign]
        for name in methods:
            setattr(cache, name, originals[name])


def held_mib(keep: walk.KeptWalk) -> float:
    """The GPU memory a kept walk holds between walks: reserved memory before and after its release."""
    if not torch.cuda.is_available():
        return 0.0
    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    keep.close()
    gc.collect()  # the caches' own reference cycles
    torch.cuda.empty_cache()
    return (before - torch.cuda.memory_reserved()) / 2**20


KINDS = get_args(target_cache.CacheKind)


KEPT = "+kept"


def _variant(text: str) -> str:
    cache, rollback, *draft = text.removesuffix(KEPT).split("/")
    if (
        cache not in KINDS
        or rollback not in ("recorded", "rerun")
        or draft[1:]
        or not set(draft) <= set(KINDS)
    ):
        raise argparse.ArgumentTypeError(f"{text!r}: CACHE/ROLLBACK[/DRAFT][+kept], e.g. graph/recorded+kept")
    return text


def _settings(variant: str, new_tokens: int) -> walk.WalkSettings:
    cache, rollback, *draft = variant.removesuffix(KEPT).split("/")
    return walk.WalkSettings(
        max_new_tokens=new_tokens,
        cache=cache,
        rollback=rollback,
        draft=draft[0] if draft else None,  # type: ignore[arg-type]
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", type=Path, default=Path("/dev/shm/dflash/model"))
    p.add_argument("--shape", default="qwen3.6-27b")
    p.add_argument("--config", type=Path, default=REFERENCE)
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--profile", type=int, default=0, help="verify steps to record with torch.profiler")
    variants = ["graph/recorded", "graph/recorded+kept", "graph/recorded/dynamic", "dynamic/recorded"]
    p.add_argument("--variants", nargs="+", default=variants, type=_variant,
                   help="CACHE/ROLLBACK[/DRAFT][+kept]: graph, static or dynamic / recorded or rerun / "
                   "the drafter's kind (default: CACHE's) / kept from the walk before")  # fmt: skip
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    if not (args.target / "MANIFEST.json").exists():
        from dflash_trainer.fixtures.shapes import write_random_target

        t0 = time.perf_counter()
        write_random_target(args.target, args.shape, device=device, progress=lambda _t: None)
        print(f"random {args.shape} target written to {args.target} in {time.perf_counter() - t0:.1f} s")
    cfg = load_config(args.config, check_paths=False)
    validate(cfg, target=read_target_info(args.target))  # the drafter's defaults that follow the target
    t0 = time.perf_counter()
    target = load_target(args.target, device=device, layer_ids=cfg.drafter.target_layer_ids, full=True)
    print(f"target loaded whole in {time.perf_counter() - t0:.1f} s")
    # As the trainer holds it: train.target_compile's capture patches the modeling modules' kernels.
    training_capture(target, cfg)
    drafter = build_drafter(cfg, target.config, device)
    vocab = target.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=g) for _ in range(args.prompts + 1)]
    model = target.model
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "prompts": args.prompts,
        "new_tokens": args.new_tokens,
        "prompt_len": args.prompt_len,
        "variants": {},
    }
    with autocast(cfg, device):
        t0 = time.perf_counter()
        warm = _settings(args.variants[0], args.new_tokens)
        walk.decode_walk(model, drafter, prompts[:1], warm)  # kernels, autotuning, allocator
        result["first_walk_s"] = time.perf_counter() - t0
        for variant in args.variants:  # side by side, in one process
            settings = _settings(variant, args.new_tokens)
            keep = walk.KeptWalk() if variant.endswith(KEPT) else None
            if keep is not None:  # the trainer's first evaluation: it builds and captures what the later keep
                walk.decode_walk(model, drafter, prompts[1:], settings, keep)
            plain = walk.decode_walk(model, drafter, prompts[1:], settings, keep)
            calls: dict[str, list[float]] = defaultdict(list)
            with phase_timers(calls):
                timed = walk.decode_walk(model, drafter, prompts[1:], settings, keep)
            per_step = plain.seconds / max(1, plain.steps)
            result["variants"][variant] = {
                "cache_run": plain.cache,
                "walk_s": plain.seconds,
                "verify_steps": plain.steps,
                "ms_per_verify_step": per_step * 1000,
                "tau": plain.tau,
                "output_ids": [w.output_ids[0, -args.new_tokens :].tolist() for w in plain.walks],
                "phases_s": {name: sum(c) for name, c in calls.items()},
                "phase_calls": {name: len(c) for name, c in calls.items()},
                # the steady state: the first verify runs eagerly and the second captures the graph
                "phase_median_ms": {name: 1000 * statistics.median(c) for name, c in calls.items()},
                "timed_walk_s": timed.seconds,
            }
            if keep is not None:
                result["variants"][variant]["kept_mib"] = held_mib(keep)
            medians = {n: round(1000 * statistics.median(c), 1) for n, c in calls.items()}
            kept = f"; {result['variants'][variant]['kept_mib']:.0f} MiB kept" if keep is not None else ""
            print(
                f"decode walk, {variant} (ran {plain.cache}): {per_step * 1000:.1f} ms per verify step "
                f"({plain.steps} steps, tau {plain.tau:.2f}); median ms per call {medians}{kept}"
            )
        outputs = {v: r.pop("output_ids") for v, r in result["variants"].items()}
        result["same_output"] = len({json.dumps(o) for o in outputs.values()}) == 1
        table = None
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            few = _settings(args.variants[0], args.profile)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                walk.decode_walk(model, drafter, prompts[1:2], few)
            averages = prof.key_averages()
            table = averages.table(sort_by="cuda_time_total", row_limit=25)
            print(table)
            print(averages.table(sort_by="cpu_time_total", row_limit=25))
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        if table:
            args.out.with_suffix(".profile.txt").write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
