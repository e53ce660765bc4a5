"""Autotune timing and length: the cold seconds of the FLA probe and the kernels its autotuning picks.

Each run is a fresh process with an empty Triton cache (TRITON_CACHE_AUTOTUNING=1, as in the unit), which runs
the FLA probe's kernels (service.gpu_probe.probe_fla, the target's Gated DeltaNet shape) with its candidates
compiled ahead, as preflight's probe does, then calls the delta rule at a training row's length. FLA's
autotune keys hold the head counts and sizes but not the sequence length, so that call reuses the probe's
picks: the kernels a rank runs are the ones tuned at the probe's length. An arm is `TIMING@LENGTH`: each
candidate timed with triton.testing.do_bench's defaults (25 ms warm-up, 100 ms of repetitions: `default`) or
briefly (5 / 25 ms: `brief`), with the probe run at LENGTH tokens. Then, at the defaults, it times the kernels
the autotuner picked: the delta rule and the causal conv at the probe's length and at the training length.
Runs alternate between the arms so a drift of the host shows in each.

Answered so far (docs/benchmarks.md#autotune-timing): the brief timing saves about 6 s of a cold probe and
picks kernels that run the delta rule up to 1.6x slower (one H100, 2026-12-06); the trainer keeps Triton's
defaults.

  python3 trainer/bench/bench_autotune_timing.py [--runs 2] [--arms default@256 default@3072]
      [--train-tokens 3072] [--out FILE]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHAPE = {"key_heads": 16, "value_heads": 48, "key_dim": 128, "value_dim": 128, "conv": 4}  # Qwen3.6-27B


def parse_arm(text: str) -> tuple[str, int]:
    """`TIMING@LENGTH` -> (timing, probe length); names the arm at fault."""
    timing, _, length = text.partition("@")
    if timing not in ("default", "brief") or not length.isdigit() or int(length) < 64:
        raise argparse.ArgumentTypeError(
            f"arm {text!r}: want TIMING@LENGTH, TIMING default or brief, LENGTH >= 64"
        )
    return timing, int(length)


def child(timing: str, tokens: int, train_tokens: int) -> dict:
    import torch
    import torch.nn.functional as F
    import triton.testing
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    from dflash_trainer.model.kernels import fla_causal_conv1d_fn
    from dflash_trainer.service import autotune_compile as autotune
    from dflash_trainer.service.gpu_probe import probe_fla

    dev, bf16 = "cuda", torch.bfloat16
    kh, vh, kd, vd, conv = (SHAPE[k] for k in ("key_heads", "value_heads", "key_dim", "value_dim", "conv"))

    def inputs(t: int) -> tuple:
        g = torch.Generator(device=dev).manual_seed(1)
        q, k = (torch.randn(1, t, kh, kd, device=dev, dtype=bf16, generator=g) for _ in range(2))
        v = torch.randn(1, t, vh, vd, device=dev, dtype=bf16, generator=g)
        gate = -torch.rand(1, t, vh, device=dev, dtype=torch.float32, generator=g)
        beta = torch.rand(1, t, vh, device=dev, dtype=bf16, generator=g)
        x = torch.randn(1, 2 * kh * kd + vh * vd, t, device=dev, dtype=bf16, generator=g)
        w = torch.randn(x.shape[1], conv, device=dev, dtype=bf16, generator=g) / conv
        return q, k, v, gate, beta, x, w

    def rule(q, k, v, gate, beta):
        return chunk_gated_delta_rule(q, k, v, g=gate, beta=beta, use_qk_l2norm_in_kernel=True)

    tally = autotune.AutotuneTally()
    default_bench = (
        triton.testing.do_bench
    )  # the autotuner's benchmark (the NVIDIA driver's, looked up per call)
    if timing == "brief":
        triton.testing.do_bench = functools.partial(default_bench, warmup=5, rep=25)
    at_once = autotune.configs_compiled_at_once(autotune.workers_from_env(), tally)
    long = inputs(train_tokens)
    start = time.perf_counter()
    with autotune.tallied(tally, torch.cuda.synchronize), at_once:
        probe_fla(*SHAPE.values(), tokens, ["grouped"])
        probe_s = time.perf_counter() - start
        rule(*long[:5])
        fla_causal_conv1d_fn(long[5], long[6], None, activation="silu")
        torch.cuda.synchronize()
    tuned_s = time.perf_counter() - start
    triton.testing.do_bench = default_bench
    figures: dict = {"arm": f"{timing}@{tokens}", "probe_s": round(probe_s, 2), "tuned_s": round(tuned_s, 2)}
    figures |= {"candidates": tally.candidates, "first_call_s": round(tally.first_call_s, 2)}
    figures["timing_s"] = round(tally.timing_s, 2)
    for where, x in (("probe", inputs(tokens)), ("train", long)):
        figures[f"rule_ms_{where}"] = round(triton.testing.do_bench(lambda x=x: rule(*x[:5])), 4)
        figures[f"conv_ms_{where}"] = round(
            triton.testing.do_bench(lambda x=x: fla_causal_conv1d_fn(x[5], x[6], None, activation="silu")), 4
        )
    # The training forward's call: q and k normalised in its compiled graph, not in FLA (model.kernel_ops).
    qn, kn = (F.normalize(t.float(), dim=-1).to(bf16) for t in long[:2])
    figures["rule_graph_ms_train"] = round(
        triton.testing.do_bench(
            lambda: chunk_gated_delta_rule(
                qn, kn, *long[2:3], g=long[3], beta=long[4], use_qk_l2norm_in_kernel=False
            )
        ),
        4,
    )
    # A kernel with nothing to tune, timed alike: when it drifts too, the machine drifted, not the picks.
    a = torch.randn(4096, 4096, device=dev, dtype=bf16)
    figures["matmul_ms"] = round(triton.testing.do_bench(lambda: a @ a), 4)
    figures["picks"] = picked_configs()
    return figures


def picked_configs() -> dict[str, list[str]]:
    """Every Triton autotuner's picks in this process (its key -> config), by kernel name, to tell runs that
    picked apart. Found by the garbage collector: FLA wraps most of them (heuristics, its own cache)."""
    import gc

    from triton.runtime.autotuner import Autotuner

    picks: dict[str, list[str]] = {}
    for obj in gc.get_objects():
        if isinstance(obj, Autotuner) and obj.cache:
            fn = getattr(obj, "base_fn", None) or obj.fn
            name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__name__', '?')}"
            picks[name] = sorted(f"{k}: {c}" for k, c in obj.cache.items())
    return picks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2, help="runs of each arm, alternating")
    parser.add_argument(
        "--arms", nargs="+", type=parse_arm, default=[("default", 256), ("brief", 256)],
        help="TIMING@LENGTH each: the autotuner's timing (default, brief) and the probe's length in tokens",
    )  # fmt: skip
    parser.add_argument(
        "--train-tokens", type=int, default=3072, help="a training row's length (reference.toml)"
    )
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--child", type=parse_arm, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(*args.child, args.train_tokens)), flush=True)
        return 0
    results: list[dict] = []
    for i in range(args.runs):
        for timing, tokens in args.arms:
            with tempfile.TemporaryDirectory(prefix="bench-autotune-") as cache:
                env = os.environ | {"TRITON_CACHE_DIR": cache, "TRITON_CACHE_AUTOTUNING": "1"}
                cmd = [sys.executable, __file__, "--child", f"{timing}@{tokens}",
                       "--train-tokens", str(args.train_tokens)]  # fmt: skip
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if proc.returncode != 0 or line is None:
                print(proc.stdout[-2000:] + proc.stderr[-4000:], file=sys.stderr)
                return 1
            result = json.loads(line[7:]) | {"run": i + 1}
            print(json.dumps({k: v for k, v in result.items() if k != "picks"}), flush=True)
            results.append(result)
    keys = [k for k in results[0] if k not in ("arm", "run", "picks")]
    arms = list(dict.fromkeys(r["arm"] for r in results))
    summary = {
        arm: {k: statistics.median(r[k] for r in results if r["arm"] == arm) for k in keys} for arm in arms
    }
    print(f"{'median':<14}" + "".join(f"{k:>15}" for k in keys))
    for arm, row in summary.items():
        print(f"{arm:<14}" + "".join(f"{round(row[k], 4):>15}" for k in keys))
    kernels = sorted({k for r in results for k in r["picks"]})
    apart = [k.rsplit(".", 1)[-1] for k in kernels if len({str(r["picks"].get(k)) for r in results}) > 1]
    print(
        f"picks: {len(kernels)} autotuned FLA kernels, {len(apart)} picked apart between runs:",
        ", ".join(apart),
    )
    if args.out:
        args.out.write_text(json.dumps({"runs": results, "median": summary}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
