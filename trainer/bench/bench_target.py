"""Benchmark: the target's forward with feature capture (TargetModel.capture), eager against compiled layers.

    python3 trainer/bench/bench_target.py --device cuda --layers 8 --out target.json   # issue 17's slice
    python3 trainer/bench/bench_target.py --device cpu --shape qwen3.6-mini --seq-len 64  # smoke run

Writes a random target of --shape cut to its first --layers layers (dflash-train model random's writer; on a
GPU in seconds) into a temporary directory, loads it as the trainer does (load_target: fast_load, FLA's
kernels on CUDA), then times `capture` on one --seq-len sequence for each --variant, side by side in one run:
  fp32-reference   eager in fp32 (asked for by name): the features every bf16 variant is compared with
  eager            the trainer's path today
  compiled-layers  model.target.compile_layers(scope="layers"): each decoder layer's forward compiled
  compiled-mlp     the same, only the MLP and norms of each layer (no linear-attention kernels traced)
Each row: median ms, tokens/s, TFLOP/s and MFU against 989 TFLOP/s (H100/H200 dense bf16) (FLOPs: 2 x layer
parameters x tokens plus causal attention of the full-attention layers; the Gated DeltaNet's chunked
recurrence is not counted, so MFU is a floor), peak memory, the dynamo graphs made, and the largest and mean
difference of its captured features from the first variant's (fp32-reference's when asked for: a compiled
forward must be as close to fp32 as eager is). --profile N adds where the device time goes (bench_drafter's
profiler).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_drafter's helpers
from bench_drafter import H100_BF16_DENSE_PEAK, environment, profile_steps, sync

from dflash_trainer.method.layers import target_layer_ids
from dflash_trainer.model.shapes import SHAPES, write_random_target
from dflash_trainer.model.target import TargetModel, compile_layers, load_target

REFERENCE = "fp32-reference"
VARIANTS: dict[str, tuple[str | None, torch.dtype]] = {  # compile scope, weights' dtype
    REFERENCE: (None, torch.float32),
    "eager": (None, torch.bfloat16),
    "compiled-layers": ("layers", torch.bfloat16),
    "compiled-mlp": ("mlp", torch.bfloat16),
}


def forward_flops(target: TargetModel, tokens: int) -> float:
    """2 x layer parameters x tokens, plus QK^T and PV of the causal full-attention layers."""
    cfg = target.config
    layers = target.model.model.layers
    dense = 2 * sum(p.numel() for p in layers.parameters()) * tokens
    full = sum(1 for t in cfg.layer_types[: len(layers)] if t == "full_attention")
    attention = full * 2 * 2 * (tokens * tokens / 2) * cfg.num_attention_heads * cfg.head_dim
    return float(dense + attention)


def time_capture(target: TargetModel, ids: torch.Tensor, warmup: int, steps: int) -> tuple[list[float], Any]:
    device = ids.device
    for _ in range(warmup):
        batch = target.capture(ids)
    sync(device)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        batch = target.capture(ids)
        sync(device)
        times.append(time.perf_counter() - t0)
    return times, batch


def bench(args: argparse.Namespace, model_dir: Path, device: torch.device) -> dict[str, Any]:
    layers = args.layers or SHAPES[args.shape].text["num_hidden_layers"]
    # Features up to the slice's last layer, so that every layer runs (the hook of the last applies the norm).
    ids = sorted({*target_layer_ids(max(layers, 4), 2)} | {layers - 1}) if layers > 1 else [0]
    ids = [i for i in ids if i < layers]
    gen = torch.Generator().manual_seed(0)
    vocab = SHAPES[args.shape].text["vocab_size"]
    tokens = torch.randint(0, vocab, (1, args.seq_len), generator=gen).to(device)
    rows, reference = [], None
    # The fp32 forward first when asked: every bf16 variant's features are then compared with it, so that
    # "compiled differs from eager" can be told apart from "compiled is as close to fp32 as eager is".
    names = sorted(args.variant, key=lambda n: n != REFERENCE)
    for name in names:
        scope, dtype = VARIANTS[name]
        target = load_target(model_dir, device=device, layer_ids=ids, dtype=dtype)
        row: dict[str, Any] = {"variant": name, "dtype": str(dtype).removeprefix("torch.")}
        try:
            if scope:
                compile_layers(target, scope)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            graphs = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
            t0 = time.perf_counter()
            times, batch = time_capture(target, tokens, args.warmup, args.steps)
            flops = forward_flops(target, args.seq_len)
            step = statistics.median(times)
            bf16_on_gpu = device.type == "cuda" and dtype == torch.bfloat16
            row |= {
                "ms_median": step * 1e3,
                "ms_all": [t * 1e3 for t in times],
                "first_calls_s": time.perf_counter() - t0 - sum(times),
                "tokens_per_s": args.seq_len / step,
                "tflops": flops / step / 1e12,
                "mfu": flops / step / H100_BF16_DENSE_PEAK if bf16_on_gpu else None,
                "dynamo_graphs": int(torch._dynamo.utils.counters["stats"]["unique_graphs"]) - graphs,
            }
            if device.type == "cuda":
                row["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
            context = batch.context.float()
            if reference is None:
                reference = context
            diff = (context - reference).abs()
            row["reference"] = names[0]
            row["max_abs_diff"] = float(diff.max())
            row["mean_abs_diff"] = float(diff.mean())
            row["mean_abs_reference"] = float(reference.abs().mean())
            if args.profile:
                capture = functools.partial(target.capture, tokens)
                row["profile"] = profile_steps(capture, args.profile, device)
        except Exception as exc:  # a variant that does not compile must not lose the others
            row["error"] = repr(exc)[:2000]
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("ms_all", "profile")}), flush=True)
        del target
        torch._dynamo.reset()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"layers": layers, "layer_ids": ids, "seq_len": args.seq_len, "rows": rows}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shape", default="qwen3.6-27b", choices=sorted(SHAPES))
    p.add_argument("--layers", type=int, default=8, help="the first N layers of the shape (default 8)")
    p.add_argument("--seq-len", type=int, default=3072)
    p.add_argument("--variant", nargs="+", choices=list(VARIANTS), default=list(VARIANTS)[1:])
    p.add_argument("--profile", type=int, default=0, help="profile N captures per variant (kernels by kind)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--dir", type=Path, default=Path("/dev/shm") if Path("/dev/shm").is_dir() else None)
    p.add_argument("--out", type=Path)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    from dflash_trainer.model.kernels import conv_backend

    result: dict[str, Any] = {
        "command": " ".join(["python3", *sys.argv]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "environment": environment(device),
    }
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-target-") as tmp:
        t0 = time.perf_counter()
        model_dir = write_random_target(Path(tmp) / "model", args.shape, layers=args.layers, device=device,
                                        progress=lambda _line: None)  # fmt: skip
        result["write_s"] = time.perf_counter() - t0
        result |= bench(args, model_dir, device)
    result["conv_backend"] = conv_backend()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    for row in result["rows"]:
        if "error" in row:
            print(f"{row['variant']:16} error: {row['error'][:200]}")
        else:
            mfu = f"{row['mfu']:.1%}" if row["mfu"] is not None else "-"
            diff = f"{row['max_abs_diff']:.3g} max, {row['mean_abs_diff']:.3g} mean vs {row['reference']}"
            print(f"{row['variant']:16} {row['ms_median']:8.1f} ms  {row['tokens_per_s']:9.0f} tok/s  "
                  f"{row['tflops']:6.1f} TFLOP/s  MFU {mfu}  diff {diff}")  # fmt: skip
    return 0 if all("error" not in r for r in result["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
