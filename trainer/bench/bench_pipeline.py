"""Pipeline benchmark: efficiency of N target + M drafter ranks, and the cost of the hook capture.

    pipeline efficiency = measured pipeline tokens/s / min(N * target tokens/s, M * drafter tokens/s)
    capture overhead    = plain forward tokens/s / capture tokens/s - 1          (goal: <= 5%)

Standalone throughputs are measured in this process on one device, then the pipeline runs as N + M local
ranks (gloo on CPU, NCCL on GPUs, one GPU per rank) on the same random models. Prints a table; writes JSON to
--out. The CPU size asserts nothing (CI machines are too noisy for a number to mean anything):

    python trainer/bench/bench_pipeline.py --size tiny --out bench-cpu.json
    python trainer/bench/bench_pipeline.py --size qwen3-8b --targets 1 --drafters 1 --out bench-h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=("tiny", "qwen3-8b"), default="tiny")
    p.add_argument("--targets", type=int, default=1)
    p.add_argument("--drafters", type=int, default=1)
    p.add_argument(
        "--steps", type=int, default=None, help="pipeline drafter steps (default: 40 tiny, 20 gpu)"
    )
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--cpu", action="store_true", help="stay on CPU even where CUDA exists")
    p.add_argument("--out", type=Path, required=True, help="JSON results")
    return p.parse_args(argv)


def run_pipeline(args: argparse.Namespace, steps: int, workdir: Path) -> dict:
    from dflash_trainer.distributed.local import spawn_local

    metrics = workdir / "pipeline.json"
    argv = ["--bench", args.size, "--targets", str(args.targets), "--drafters", str(args.drafters)]
    argv += [
        "--steps",
        str(steps),
        "--metrics-out",
        str(metrics),
        "--timeline",
        str(args.out.with_suffix(".png")),
    ]
    # Throughput over the steady state only: the first items carry compilation and communicator set-up.
    argv += ["--log-every", str(max(1, steps // 4)), "--warmup-items", str(max(1, steps // 4))]
    if args.cpu:
        argv.append("--cpu")
    spawn_local(argv, args.targets + args.drafters, preload=["dflash_trainer.train.loop"])
    return json.loads(metrics.read_text())


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    from dflash_trainer.distributed.plan import measure_standalone
    from dflash_trainer.fixtures.bench import setup_from_bench

    cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if not cuda:
        torch.set_num_threads(1)  # the same as each pipeline rank gets (OMP_NUM_THREADS=1 below)
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    steps = args.steps or 40
    ranks = args.targets + args.drafters
    result: dict = {
        "size": args.size,
        "targets": args.targets,
        "drafters": args.drafters,
        "device": torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu",
        "torch": torch.__version__,
    }

    start = time.perf_counter()
    setup = setup_from_bench(args.size, device, steps=args.warmup + args.iters + 1)
    s = measure_standalone(setup, device, warmup=args.warmup, iters=args.iters)
    result["standalone"] = s.as_dict()
    result["standalone_s"] = time.perf_counter() - start
    del setup
    if cuda:
        torch.cuda.empty_cache()

    ideal = min(args.targets * s.target_tokens_per_s, args.drafters * s.drafter_tokens_per_s)
    result["ideal_tokens_per_s"] = ideal
    if cuda and torch.cuda.device_count() < ranks:
        result["pipeline"] = None
        result["skipped"] = f"{ranks} ranks need {ranks} GPUs, {torch.cuda.device_count()} visible"
    else:
        with tempfile.TemporaryDirectory() as tmp:
            pipe = run_pipeline(args, steps, Path(tmp))
        result["pipeline"] = pipe
        result["pipeline_tokens_per_s"] = pipe["pipeline_tokens_per_s"]
        result["pipeline_efficiency"] = pipe["pipeline_tokens_per_s"] / ideal

    rows = [
        ("one target, capture (tokens/s)", f"{s.target_tokens_per_s:,.0f}"),
        ("one target, plain forward (tokens/s)", f"{s.plain_tokens_per_s:,.0f}"),
        ("capture overhead (goal <= 5%)", f"{s.capture_overhead:+.1%}"),
        ("one drafter, train step (tokens/s)", f"{s.drafter_tokens_per_s:,.0f}"),
        (f"ideal {args.targets}:{args.drafters} = min(N*t, M*d) (tokens/s)", f"{ideal:,.0f}"),
    ]
    if result["pipeline"] is not None:
        rows += [
            (
                f"pipeline {args.targets}:{args.drafters} measured (tokens/s)",
                f"{result['pipeline_tokens_per_s']:,.0f}",
            ),
            ("pipeline efficiency", f"{result['pipeline_efficiency']:.1%}"),
        ]
    else:
        rows.append(("pipeline", f"skipped: {result['skipped']}"))
    width = max(len(k) for k, _ in rows)
    print(f"bench_pipeline {args.size} on {result['device']}")
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
