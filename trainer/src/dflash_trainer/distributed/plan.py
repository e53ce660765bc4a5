"""`dflash-train plan GPUS`: measure one target's and one drafter's throughput, print the splits of GPUS.

With t = one target rank's tokens/s (capture) and d = one drafter rank's tokens/s (training step), N target
and M drafter ranks (N + M = GPUS) train at T(N, M) = min(N*t, M*d) tokens/s: the slower side is saturated,
the faster one waits. Efficiency(N:M) = min(N*t, M*d) / max(N*t, M*d), the busy fraction of the faster side
(1.0: no device waits). The best split maximises T (hence T / GPUS per device); ties go to the higher
efficiency.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class Candidate:
    targets: int
    drafters: int
    tokens_per_s: float  # predicted pipeline throughput
    efficiency: float


def efficiency(n: int, m: int, t: float, d: float) -> float:
    return min(n * t, m * d) / max(n * t, m * d)


def candidates(gpus: int, t: float, d: float) -> list[Candidate]:
    """Every split of `gpus` into N >= 1 targets and M >= 1 drafters, best first."""
    out = [
        Candidate(n, gpus - n, min(n * t, (gpus - n) * d), efficiency(n, gpus - n, t, d))
        for n in range(1, gpus)
    ]
    return sorted(out, key=lambda c: (-c.tokens_per_s, -c.efficiency, c.targets))


def plan_table(gpus: int, t: float, d: float) -> str:
    lines = [f"one target: {t:.0f} tokens/s, one drafter: {d:.0f} tokens/s; splits of {gpus} devices:"]
    lines.append(f"{'N:M':>7}  {'tokens/s':>10}  {'per device':>10}  {'efficiency':>10}")
    for i, c in enumerate(candidates(gpus, t, d)):
        mark = "  <- best" if i == 0 else ""
        split = f"{c.targets}:{c.drafters}"
        per_device = c.tokens_per_s / gpus
        lines.append(f"{split:>7}  {c.tokens_per_s:>10.0f}  {per_device:>10.0f}  {c.efficiency:>10.1%}{mark}")
    return "\n".join(lines)


# ---- measurement (also used by bench/bench_pipeline.py) ----


@dataclass
class Standalone:
    target_tokens_per_s: float  # capture: forward + hooks + concatenation of the features
    plain_tokens_per_s: float  # the same truncated forward without hooks
    drafter_tokens_per_s: float  # one optimizer step of the drafter on a captured batch
    tokens_per_item: int

    @property
    def capture_overhead(self) -> float:
        """Fractional slow-down of the capture against the plain forward (goal <= 0.05)."""
        return self.plain_tokens_per_s / self.target_tokens_per_s - 1.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"capture_overhead": self.capture_overhead}


def _timed(fn: Callable[[], Any], device: torch.device, warmup: int, iters: int) -> float:
    """Seconds per call, after warm-up (compile, allocator, autotuning)."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / iters


def _measure_target(setup: Any, batch: Any, device: torch.device, warmup: int, iters: int) -> tuple:
    """(plain forward s, capture s, captured batch) of one target; the target is dropped on return."""
    from dflash_trainer.data.batch import TargetBatch
    from dflash_trainer.runtime import autocast
    from dflash_trainer.train.target_side import training_capture

    cfg = setup.cfg
    target = setup.make_target(cfg.drafter.target_layer_ids)
    body = target.model.model
    forward = training_capture(target, cfg)
    layers_as_trained = getattr(forward, "swapped_in", contextlib.nullcontext)  # compiled ones, if compiled

    def plain() -> None:
        with torch.no_grad(), autocast(cfg, device), layers_as_trained():
            body(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)

    def capture() -> Any:
        with autocast(cfg, device):
            return forward(batch.input_ids, batch.attention_mask, batch.loss_mask)

    # The plain forward runs with the capture hooks taken off the layers, then they are put back.
    saved = [(layer, dict(layer._forward_hooks)) for layer in body.layers if layer._forward_hooks]
    for layer, _ in saved:
        layer._forward_hooks.clear()
    plain_s = _timed(plain, device, warmup, iters)
    for layer, hooks in saved:
        layer._forward_hooks.update(hooks)
    capture_s = _timed(capture, device, warmup, iters)
    out = capture()
    return plain_s, capture_s, TargetBatch(out.input_ids, out.loss_mask, out.context.to(setup.dtype))


def _measure_drafter(setup: Any, captured: Any, device: torch.device, warmup: int, iters: int) -> float:
    from dflash_trainer.train.drafter_side import DrafterSide
    from dflash_trainer.train.schedule import Horizon
    from dflash_trainer.train.setup import head_only

    hz = Horizon(warmup + iters + 1, "steps")
    drafter = DrafterSide(setup.cfg, head_only(setup), hz, device=device, save=False)
    steps = iter(range(warmup + iters))
    return _timed(lambda: drafter.step(next(steps), 0, captured), device, warmup, iters)


def measure_standalone(setup: Any, device: torch.device, *, warmup: int = 2, iters: int = 5) -> Standalone:
    """One target, then one drafter on `device` (the target is freed before the drafter is built)."""
    batch = setup.make_rows()(0).to(device)
    tokens = batch.input_ids.numel()
    plain_s, capture_s, captured = _measure_target(setup, batch, device, warmup, iters)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    drafter_s = _measure_drafter(setup, captured, device, warmup, iters)
    gc.collect()
    return Standalone(tokens / capture_s, tokens / plain_s, tokens / drafter_s, tokens)


# ---- the command ----


def add_plan_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("gpus", type=int, help="devices to split between target and drafter ranks")
    parser.add_argument(
        "config", nargs="?", type=Path, help="training TOML whose target and drafter to measure"
    )
    parser.add_argument("--bench", choices=("tiny", "qwen3-8b"), help="measure random models of a bench size")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda[:i]")
    parser.add_argument(
        "--figures",
        nargs=2,
        type=float,
        metavar=("TARGET_TOK_S", "DRAFTER_TOK_S"),
        help="split from figures measured before (one target's, one drafter's tokens/s) instead of measuring",
    )
    return parser


def plan_main(args: argparse.Namespace) -> int:
    from dflash_trainer.config import load_config
    from dflash_trainer.fixtures.bench import setup_from_bench
    from dflash_trainer.train.setup import setup_from_config

    if args.gpus < 2:
        raise SystemExit("plan: need at least 2 devices (1 target + 1 drafter)")
    if args.figures is not None:
        t, d = args.figures
        if t <= 0 or d <= 0:
            raise SystemExit(f"plan: --figures must be two positive rates, got {t} and {d}")
        print(plan_table(args.gpus, t, d))
        best = candidates(args.gpus, t, d)[0]
        print(f"set [topology] targets = {best.targets}, drafters = {best.drafters}")
        return 0
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
    if args.bench:
        setup = setup_from_bench(args.bench, device, steps=args.warmup + args.iters + 1)
    elif args.config is not None:
        setup = setup_from_config(load_config(args.config), device)
    else:
        raise SystemExit("plan: give a training config or --bench SIZE")
    s = measure_standalone(setup, device, warmup=args.warmup, iters=args.iters)
    print(plan_table(args.gpus, s.target_tokens_per_s, s.drafter_tokens_per_s))
    print(f"capture overhead against the plain forward: {s.capture_overhead:+.1%}")
    best = candidates(args.gpus, s.target_tokens_per_s, s.drafter_tokens_per_s)[0]
    print(f"set [topology] targets = {best.targets}, drafters = {best.drafters}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = add_plan_arguments(argparse.ArgumentParser(prog="dflash-train plan", description=__doc__))
    return plan_main(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
