"""Benchmark: the target's forward with feature capture (TargetModel.capture): eager, compiled, CUDA graphs.

    python3 trainer/bench/bench_target.py --device cuda --layers 8 --out target.json   # the reference slice
    python3 trainer/bench/bench_target.py --device cpu --shape qwen3.6-mini --seq-len 64  # smoke run

Writes a random target of --shape cut to its first --layers layers (dflash-train model random's writer; on a
GPU in seconds) into a temporary directory, loads it as the trainer does (load_target: fast_load, FLA's
kernels on CUDA), then times `capture` on one --seq-len sequence for each --variant, side by side in one run:
  fp32-reference     eager in fp32 (asked for by name): the features every bf16 variant is compared with
  eager              the trainer's path today
  eager-plain        the same forward without capture (hooks idle): the base of the capture overhead
  compiled-layers    model.target.compile_layers(scope="layers"): each decoder layer's forward compiled
  compiled-mlp       the same, only the MLP and norms of each layer (no linear-attention kernels traced)
  compiled-mlp-norm  compiled-mlp and the Gated DeltaNet's gated RMSNorm
  graph              the unpadded capture (TargetModel.unpadded_features) replayed from a CUDA graph
  graph-plain        the plain forward replayed from a CUDA graph: the base of graph's capture overhead
  graph-mlp          compiled-mlp inside the CUDA graph; graph-mlp-norm: compiled-mlp-norm inside it
  compiled-layers-opaque  each whole layer compiled, the linear-attention kernels opaque to dynamo;
  graph-layers-opaque     the same inside the CUDA graph (graph-plain-layers-opaque: its plain forward)
  graph-layers-opaque-repeat  the same with transformers' q/k head repeat kept (skip_repeat=False)
  graph-layers-fused      graph-layers-opaque with each layer's sibling projections in one GEMM
                          (model.fused_projections; graph-plain-layers-fused: its plain forward)
  trainer-compiled   the trainer's train.target_compile forward (CompiledCapture: layers compiled with
                     dynamic shapes, FLA opaque, projections fused, swapped in per call; no CUDA graph)
  trainer-compiled-unfused  the same without the fused projections
  trainer-graphed    what train.target_compile runs on CUDA: trainer-compiled replayed from a CUDA graph per
                     row-length bucket (GraphedCapture; trainer-graphed-plain: its plain forward)
Each row: median ms (wall, synchronised), ms per call of --steps calls queued back to back with one sync at
the end (`pipelined_ms`: how a target rank runs them, one forward after the other), the host's enqueue time
of one call (no sync: when it is close to the wall time, the forward is bound by launching kernels),
tokens/s, TFLOP/s and MFU against 989 TFLOP/s
(H100/H200 dense bf16) and against the bf16 matmul rate measured in the same run (FLOPs: 2 x layer parameters
x tokens plus causal attention of the full-attention layers; the Gated DeltaNet's chunked recurrence is not
counted, so MFU is a floor), peak memory, the dynamo graphs made, and the largest and mean difference of its
captured features from the first variant's (fp32-reference's when asked for: a faster forward must be as
close to fp32 as eager is). A variant that fails (a kernel that cannot be captured, say) prints where, and
the others still run.

--trace N: N more calls per variant, each under its own torch.profiler session; the device's timeline is read
from the exported Chrome trace (every kernel, memcpy and memset event, not the profiler's averages): kernels
busy (the union of their intervals) against the span from the first kernel's start to the last one's end,
the idle gaps between them (the largest, with the kernels on either side), and busy time by kernel kind.
--trace-dir keeps each variant's last trace (gzipped, for chrome://tracing or Perfetto). --profile N adds
bench_drafter's profiler summary (key averages) as before.
"""

from __future__ import annotations

import argparse
import functools
import gc
import gzip
import json
import re
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_drafter's helpers
from bench_drafter import H100_BF16_DENSE_PEAK, KERNEL_KINDS, environment, matmul_rate, profile_steps, sync

from dflash_trainer.fixtures.shapes import SHAPES, write_random_target
from dflash_trainer.method.layers import target_layer_ids
from dflash_trainer.model.target import (
    CompiledCapture,
    GraphedCapture,
    GraphedForward,
    TargetModel,
    compile_layers,
    graph_features,
    load_target,
    unpadded_masks,
)


@dataclass(frozen=True)
class Variant:
    scope: str | None = None  # compile_layers' scope
    dtype: torch.dtype = torch.bfloat16
    graph: bool = False  # replayed from a CUDA graph (the unpadded path)
    capture: bool = True  # False: the plain forward, hooks idle (the base of the capture overhead)
    repeat: bool = False  # True: transformers' own q/k head repeat before the delta rule (not grouped heads)
    trainer: bool = False  # train.target_compile's forward (CompiledCapture: dynamic shapes, no graph)
    fuse: bool = False  # sibling projections in one GEMM (model.fused_projections)


REFERENCE = "fp32-reference"
VARIANTS: dict[str, Variant] = {
    REFERENCE: Variant(dtype=torch.float32),
    "eager": Variant(),
    "eager-plain": Variant(capture=False),
    "compiled-layers": Variant("layers"),
    "compiled-mlp": Variant("mlp"),
    "compiled-mlp-norm": Variant("mlp-norm"),
    "graph": Variant(graph=True),
    "graph-plain": Variant(graph=True, capture=False),
    "graph-mlp": Variant("mlp", graph=True),
    "graph-mlp-norm": Variant("mlp-norm", graph=True),
    "compiled-layers-opaque": Variant("layers-opaque"),
    "graph-layers-opaque": Variant("layers-opaque", graph=True),
    "graph-plain-layers-opaque": Variant("layers-opaque", graph=True, capture=False),
    "graph-layers-opaque-repeat": Variant("layers-opaque", graph=True, repeat=True),
    "graph-layers-fused": Variant("layers-opaque", graph=True, fuse=True),
    "graph-plain-layers-fused": Variant("layers-opaque", graph=True, capture=False, fuse=True),
    "trainer-compiled": Variant(trainer=True, fuse=True),
    "trainer-compiled-unfused": Variant(trainer=True),
    # What train.target_compile runs on CUDA: the compiled layers replayed from a CUDA graph (GraphedCapture).
    "trainer-graphed": Variant(trainer=True, fuse=True, graph=True),
    "trainer-graphed-plain": Variant(trainer=True, fuse=True, graph=True, capture=False),
}
# The fastest unfused variant (graph-layers-opaque) and the fused projections, each with its plain forward,
# beside eager; the trainer's compiled forward with and without the fusion.
DEFAULT_VARIANTS = [
    "eager",
    "eager-plain",
    "graph-layers-opaque",
    "graph-plain-layers-opaque",
    "graph-layers-fused",
    "graph-plain-layers-fused",
    "trainer-compiled-unfused",
    "trainer-compiled",
    "trainer-graphed",
    "trainer-graphed-plain",
]
OVERHEAD_PAIRS = (  # capture against the plain forward
    ("eager", "eager-plain"),
    ("graph", "graph-plain"),
    ("graph-layers-opaque", "graph-plain-layers-opaque"),
    ("graph-layers-fused", "graph-plain-layers-fused"),
    ("trainer-graphed", "trainer-graphed-plain"),
)

TARGET_KERNEL_KINDS = (  # before bench_drafter's kinds: the target's own kernels
    (
        "linear attention (FLA)",
        re.compile(r"chunk|delta|conv1d|l2norm|solve_tril|recompute_w_u|kkt|gated", re.I),
    ),
    ("attention (SDPA)", re.compile(r"flash|fmha|attention|sdpa", re.I)),
    *KERNEL_KINDS,
)
DEVICE_EVENTS = ("kernel", "gpu_memcpy", "gpu_memset")


def forward_flops(target: TargetModel, tokens: int) -> float:
    """2 x layer parameters x tokens, plus QK^T and PV of the causal full-attention layers."""
    cfg = target.config
    layers = target.model.model.layers
    dense = 2 * sum(p.numel() for p in layers.parameters()) * tokens
    full = sum(1 for t in cfg.layer_types[: len(layers)] if t == "full_attention")
    attention = full * 2 * 2 * (tokens * tokens / 2) * cfg.num_attention_heads * cfg.head_dim
    return float(dense + attention)


# ---- the forward of each variant ----


def plain_forward(target: TargetModel, masks: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """The decoder stack's forward without capture (the hooks stay idle): what capture adds to."""

    @torch.no_grad()
    def forward(ids: torch.Tensor) -> torch.Tensor:
        mask = torch.ones_like(ids) if masks is None else masks
        return target.model.model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state

    return forward


def variant_forward(target: TargetModel, variant: Variant, ids: torch.Tensor) -> Callable[[], torch.Tensor]:
    """One call of the variant's forward on `ids`; a graph is captured here (its warm-up included)."""
    if variant.trainer:
        compiled = CompiledCapture(target, fuse=variant.fuse)
        if not variant.graph:
            return lambda: compiled(ids).context
        if variant.capture:
            graphed = GraphedCapture(compiled)
            return lambda: graphed(ids).context
        with compiled.swapped_in():
            plain = GraphedForward(plain_forward(target, unpadded_masks(target.config)), ids)
        return functools.partial(plain, ids)
    if not variant.graph:
        if variant.capture:
            return lambda: target.capture(ids).context
        return functools.partial(plain_forward(target, None), ids)
    fn = target.unpadded_features if variant.capture else plain_forward(target, unpadded_masks(target.config))
    graphed = graph_features(target, ids) if variant.capture else GraphedForward(fn, ids)
    return functools.partial(graphed, ids)


def time_forward(
    fn: Callable[[], torch.Tensor], device: torch.device, warmup: int, steps: int
) -> dict[str, Any]:
    """Median wall time (synchronised) and host enqueue time (returned, not synchronised) per call."""
    for _ in range(warmup):
        fn()
    sync(device)
    walls, enqueues = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        sync(device)
        walls.append(time.perf_counter() - t0)
        enqueues.append(t1 - t0)
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    sync(device)
    pipelined = (time.perf_counter() - t0) / steps
    return {
        "ms_median": statistics.median(walls) * 1e3,
        "ms_all": [t * 1e3 for t in walls],
        "pipelined_ms": pipelined * 1e3,
        "host_enqueue_ms_median": statistics.median(enqueues) * 1e3,
    }


# ---- the device's timeline from the profiler's trace ----


def device_intervals(trace: dict[str, Any]) -> list[tuple[float, float, str]]:
    """(start us, end us, name) of every kernel, memcpy and memset in a Chrome trace, by start."""
    out = [
        (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), str(e.get("name", "")))
        for e in trace.get("traceEvents", [])
        if e.get("ph") == "X" and e.get("cat") in DEVICE_EVENTS
    ]
    return sorted(out)


def kind_of(name: str) -> str:
    return next((kind for kind, pattern in TARGET_KERNEL_KINDS if pattern.search(name)), "other")


def timeline(intervals: list[tuple[float, float, str]], top_gaps: int = 5) -> dict[str, Any]:
    """Busy time (the union of the intervals), span, idle gaps and busy time by kind, in ms."""
    if not intervals:
        return {"events": 0, "busy_ms": 0.0, "span_ms": 0.0, "idle_ms": 0.0, "gaps_over_20us": 0, "gaps": [],
                "kinds_ms": {}}  # fmt: skip
    busy, gaps, kinds = 0.0, [], {}
    end, before = intervals[0][0], intervals[0][2]
    for start, stop, name in intervals:
        if start > end:
            gaps.append((start - end, before, name))
        busy += max(0.0, stop - max(start, end))
        if stop > end:
            end, before = stop, name
        kind = kind_of(name)
        kinds[kind] = kinds.get(kind, 0.0) + (stop - start) / 1e3
    span = end - intervals[0][0]
    gaps.sort(key=lambda g: -g[0])
    return {
        "events": len(intervals),
        "busy_ms": busy / 1e3,
        "span_ms": span / 1e3,
        "idle_ms": (span - busy) / 1e3,
        "gaps_over_20us": sum(1 for g in gaps if g[0] > 20),
        "gaps": [[round(us, 1), a[:80], b[:80]] for us, a, b in gaps[:top_gaps]],
        "kinds_ms": dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
    }


def trace_forward(
    fn: Callable[[], Any], calls: int, device: torch.device, keep: Path | None
) -> dict[str, Any]:
    """`calls` calls, each under its own profiler session, read from the exported trace; medians per call."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    per_call = []
    with tempfile.TemporaryDirectory(prefix="bench-target-trace-") as tmp:
        path = Path(tmp) / "trace.json"
        for _ in range(calls):
            sync(device)
            with profile(activities=activities) as prof:
                fn()
                sync(device)
            prof.export_chrome_trace(str(path))
            per_call.append(timeline(device_intervals(json.loads(path.read_text()))))
        if keep is not None:
            keep.parent.mkdir(parents=True, exist_ok=True)
            with gzip.open(keep, "wb") as f:
                f.write(path.read_bytes())
    keys = ("events", "busy_ms", "span_ms", "idle_ms", "gaps_over_20us")
    summary = {key: statistics.median(c[key] for c in per_call) for key in keys}
    last = per_call[-1]
    return summary | {"calls": calls, "gaps_last_call": last["gaps"], "kinds_ms_last_call": last["kinds_ms"]}


# ---- one variant ----


def failure(exc: BaseException) -> str:
    """The exception and the innermost frames where it was raised (which op could not be captured)."""
    frames = traceback.extract_tb(exc.__traceback__)[-4:]
    where = " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames))
    return f"{type(exc).__name__}: {str(exc).strip()[:1500]} [at {where}]"


def run_variant(
    name: str, model_dir: Path, ids_layers: list[int], tokens: torch.Tensor, args: argparse.Namespace
) -> tuple[dict[str, Any], torch.Tensor | None]:
    variant, device = VARIANTS[name], tokens.device
    row: dict[str, Any] = {"variant": name, "dtype": str(variant.dtype).removeprefix("torch.")}
    target = load_target(
        model_dir, device=device, layer_ids=ids_layers, dtype=variant.dtype, skip_repeat=not variant.repeat
    )
    output = None
    try:
        row["flops"] = forward_flops(target, tokens.shape[1])
        if variant.scope:
            compile_layers(target, variant.scope, fuse=variant.fuse)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        graphs = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
        t0 = time.perf_counter()
        fn = variant_forward(target, variant, tokens)
        row |= time_forward(fn, device, args.warmup, args.steps)
        row["first_calls_s"] = time.perf_counter() - t0 - sum(row["ms_all"]) / 1e3
        row["dynamo_graphs"] = int(torch._dynamo.utils.counters["stats"]["unique_graphs"]) - graphs
        if device.type == "cuda":
            row["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        output = fn().float()  # the graph's output is static: copied before anything else runs
    except Exception as exc:  # a variant that does not compile or capture must not lose the others
        row["error"] = failure(exc)
    try:  # the accounting's failure keeps the timings
        if args.trace and output is not None:
            keep = args.trace_dir / f"{name}.trace.json.gz" if args.trace_dir else None
            row["timeline"] = trace_forward(fn, args.trace, device, keep)
        if args.profile and output is not None:
            row["profile"] = profile_steps(fn, args.profile, device)
    except Exception as exc:
        row["timeline_error"] = failure(exc)
    del target
    gc.collect()  # the capture hooks hold the model in a reference cycle: free it before the next variant
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row, output


def rates(row: dict[str, Any], seq_len: int, matmul: float | None, on_gpu: bool) -> dict[str, Any]:
    step, flops = row["ms_median"] / 1e3, row["flops"]
    bf16_on_gpu = on_gpu and row["dtype"] == "bfloat16"
    pipelined = row["pipelined_ms"] / 1e3
    return {
        "tokens_per_s": seq_len / step,
        "tflops": flops / step / 1e12,
        "mfu": flops / step / H100_BF16_DENSE_PEAK if bf16_on_gpu else None,
        "mfu_vs_matmul": flops / step / matmul if bf16_on_gpu and matmul else None,
        "mfu_pipelined": flops / pipelined / H100_BF16_DENSE_PEAK if bf16_on_gpu else None,
    }


def compare(row: dict[str, Any], output: torch.Tensor, reference: torch.Tensor, name: str) -> None:
    diff = (output - reference).abs()
    row |= {
        "reference": name,
        "max_abs_diff": float(diff.max()),
        "mean_abs_diff": float(diff.mean()),
        "mean_abs_reference": float(reference.abs().mean()),
    }


def bench(args: argparse.Namespace, model_dir: Path, device: torch.device) -> dict[str, Any]:
    layers = args.layers or SHAPES[args.shape].text["num_hidden_layers"]
    # Features up to the slice's last layer, so that every layer runs (the hook of the last applies the norm).
    ids = sorted({*target_layer_ids(max(layers, 4), 2)} | {layers - 1}) if layers > 1 else [0]
    ids = [i for i in ids if i < layers]
    gen = torch.Generator().manual_seed(0)
    vocab = SHAPES[args.shape].text["vocab_size"]
    tokens = torch.randint(0, vocab, (1, args.seq_len), generator=gen).to(device)
    matmul = matmul_rate(device) if device.type == "cuda" else None
    rows: list[dict[str, Any]] = []
    references: dict[bool, tuple[str, torch.Tensor]] = {}  # capture or plain -> the first such output
    # The fp32 forward first when asked, graphs last (a failed capture must not disturb the others): every
    # bf16 variant's features are compared with fp32's, so that "differs from eager" can be told apart from
    # "is as close to fp32 as eager is".
    names = sorted(args.variant, key=lambda n: (n != REFERENCE, VARIANTS[n].graph))
    for name in names:
        row, output = run_variant(name, model_dir, ids, tokens, args)
        if output is not None and "error" not in row:
            row |= rates(row, args.seq_len, matmul, device.type == "cuda")
            kind = VARIANTS[name].capture
            references.setdefault(kind, (name, output))
            compare(row, output, references[kind][1], references[kind][0])
        rows.append(row)
        brief = {k: v for k, v in row.items() if k not in ("ms_all", "profile", "timeline")}
        print(json.dumps(brief), flush=True)
        del output
    return {
        "layers": layers,
        "layer_ids": ids,
        "seq_len": args.seq_len,
        "matmul_tflops": matmul and matmul / 1e12,
        "rows": rows,
        "capture_overhead": capture_overhead(rows),
    }


def capture_overhead(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Capture's time over the plain forward's, minus one, for each pair measured without error."""
    ms = {r["variant"]: r["ms_median"] for r in rows if "error" not in r}
    return {f"{a} / {b}": ms[a] / ms[b] - 1 for a, b in OVERHEAD_PAIRS if a in ms and b in ms}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shape", default="qwen3.6-27b", choices=sorted(SHAPES))
    p.add_argument("--layers", type=int, default=8, help="the first N layers of the shape (default 8)")
    p.add_argument("--seq-len", type=int, default=3072)
    p.add_argument("--variant", nargs="+", choices=list(VARIANTS), default=DEFAULT_VARIANTS)
    p.add_argument("--trace", type=int, default=0, help="N calls per variant read from the profiler's trace")
    p.add_argument("--trace-dir", type=Path, help="keep each variant's last trace here (gzipped JSON)")
    p.add_argument("--profile", type=int, default=0, help="profile N captures per variant (kernels by kind)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--dir", type=Path, default=Path("/dev/shm") if Path("/dev/shm").is_dir() else None)
    p.add_argument("--out", type=Path)
    return p.parse_args(argv)


def fmt(value: float | None, spec: str, none: str = "-") -> str:
    return none if value is None else format(value, spec)


def summary(result: dict[str, Any]) -> str:
    """The closing table: one line per variant, its timeline's line under it, the capture overheads."""
    lines = []
    for row in result["rows"]:
        if "error" in row:
            lines.append(f"{row['variant']:18} FAILED {row['error'][:600]}")
            continue
        diff = f"{row['max_abs_diff']:.3g} max, {row['mean_abs_diff']:.3g} mean vs {row['reference']}"
        lines.append(
            f"{row['variant']:18} {row['ms_median']:7.2f} ms (host {row['host_enqueue_ms_median']:6.2f})"
            f"  {row['tokens_per_s']:8.0f} tok/s  {row['tflops']:6.1f} TFLOP/s  MFU {fmt(row['mfu'], '.1%')}"
            f" (matmul {fmt(row['mfu_vs_matmul'], '.1%')}; back to back {row['pipelined_ms']:.2f} ms,"
            f" MFU {fmt(row['mfu_pipelined'], '.1%')})  diff {diff}"
        )
        if "timeline_error" in row:
            lines.append(f"{'':18} trace FAILED {row['timeline_error'][:300]}")
        t = row.get("timeline")
        if t:
            kinds = ", ".join(f"{k} {v:.1f}" for k, v in list(t["kinds_ms_last_call"].items())[:6])
            lines.append(
                f"{'':18} trace: kernels busy {t['busy_ms']:.2f} ms of a {t['span_ms']:.2f} ms device span "
                f"(idle {t['idle_ms']:.2f}, {t['events']:.0f} events, "
                f"{t['gaps_over_20us']:.0f} gaps > 20 us); "
                f"by kind ms: {kinds}"
            )
    for pair, value in result["capture_overhead"].items():
        lines.append(f"capture overhead {pair}: {value:+.2%}")
    return "\n".join(lines)


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
    print(summary(result))
    return 0 if all("error" not in r for r in result["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
