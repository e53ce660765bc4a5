"""Drafter training step benchmark: tokens/s, MFU and peak memory of DrafterSide.step (docs/benchmarks.md).

Builds reference-shaped drafters from DrafterSpec (no target model): random context features [B, T, K*H],
a random frozen embedding and LM head of the full vocabulary, and times the trainer's own step (anchors,
forward_blocks, chunked loss, backward, clip, fused AdamW; bf16 autocast over fp32 master weights on CUDA).

    python3 trainer/bench/bench_drafter.py --device cuda --out $OUT/drafter.json   # H200
    python3 trainer/bench/bench_drafter.py --device cpu --out /tmp/drafter.json    # tiny shapes, < 1 min

FLOP accounting (per step; B sequences, T context tokens, N = anchors*Bs block slots, P supervised slots):
  model FLOPs (what the step needs; MFU):
    drafter layers   6 * params * tokens: q, o and MLP over N slots, k and v over T + N keys
    fc               4 * (K*H*H) * T          inputs are target features: no input gradient
    attention        12 * d * Hq * visible (query, key) pairs   (fwd 4d, bwd 8d per pair and head)
    LM head          4 * H * V * P            frozen: input gradient only
  executed FLOPs (HFU) add what the implementation spends beyond that: attention over every pair the kernel
  computes (dense: N*(T+N); flex: all pairs of kept 128x128 tiles) at 14d (the backward recomputes scores),
  the chunked loss's logit recompute (2*H*V*P) and, with gradient checkpointing, the layers' forward again.
  `mfu_6x` uses the brief's convention (6x for the LM head and fc, as if they were trained) for comparison.
MFU is against the bf16 dense datasheet peak (989 TFLOP/s on H100/H200 SXM) and against the 8192^3 bf16
matmul rate this script measures.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

# Runs from a checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch
from torch import nn

from dflash_trainer.config import DataConfig, DrafterConfig, LoopConfig, ModelConfig, TrainConfig
from dflash_trainer.data.batch import TargetBatch
from dflash_trainer.method.anchors import sample_anchors
from dflash_trainer.method.layers import target_layer_ids
from dflash_trainer.method.loss import LOSS_IMPLS
from dflash_trainer.method.mask import block_attention_mask
from dflash_trainer.model.attention import flex_block_mask, resolve_impl
from dflash_trainer.model.drafter import FULL, SLIDING, DFlashDrafter, DrafterSpec
from dflash_trainer.train.drafter_side import DrafterSide
from dflash_trainer.train.schedule import Horizon
from dflash_trainer.train.setup import prepare_drafter

H100_BF16_DENSE_PEAK = 989e12  # H100/H200 SXM datasheet, dense (no sparsity)
NUM_TARGET_LAYERS = 64  # Qwen3.6-27B
FLEX_TILE = 128


@dataclass(frozen=True)
class Shape:
    """Everything that sets the cost of one step."""

    hidden: int
    layers: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    seq_len: int
    anchors: int
    block: int
    batch: int
    window: int


@dataclass(frozen=True)
class Variant:
    attention: str  # auto | flex | dense
    compile: bool
    gradient_checkpointing: bool
    loss_chunk: int
    # method.loss.LOSS_IMPLS: the input gradient in the forward (its softmax in one Triton kernel, or in
    # torch), or each chunk recomputed
    loss: str = "fused"


REFERENCE_FFN = {4096: 12288, 5120: 17408}  # Qwen3-8B-like and Qwen3.6-27B's drafter


def reference_shape(hidden: int, layers: int, args: argparse.Namespace) -> Shape:
    return Shape(
        hidden=hidden,
        layers=layers,
        ffn=REFERENCE_FFN.get(hidden, 3 * hidden),
        heads=32,
        kv_heads=8,
        head_dim=128,
        vocab=args.vocab,
        seq_len=args.seq_len,
        anchors=args.anchors,
        block=args.block,
        batch=args.batch,
        window=2048,
    )


def tiny_shape(hidden: int, layers: int, args: argparse.Namespace) -> Shape:
    """CPU smoke size: the same structure (GQA 2:1, sliding + full layers, block 16), small numbers."""
    return Shape(
        hidden=hidden,
        layers=layers,
        ffn=3 * hidden,
        heads=4,
        kv_heads=2,
        head_dim=hidden // 4,
        vocab=2048,
        seq_len=128,
        anchors=8,
        block=args.block,
        batch=args.batch,
        window=64,
    )


def drafter_spec(shape: Shape) -> DrafterSpec:
    """The reference layout: sliding-window layers and one full layer last (all full for one layer)."""
    types = [SLIDING] * (shape.layers - 1) + [FULL]
    return DrafterSpec(
        hidden_size=shape.hidden,
        intermediate_size=shape.ffn,
        num_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        vocab_size=shape.vocab,
        num_target_layers=NUM_TARGET_LAYERS,
        target_layer_ids=target_layer_ids(NUM_TARGET_LAYERS, shape.layers),
        block_size=shape.block,
        mask_token_id=shape.vocab - 1,
        layer_types=types,
        sliding_window=shape.window if SLIDING in types else None,
    )


def train_config(shape: Shape, variant: Variant, device: torch.device) -> TrainConfig:
    """A TrainConfig for DrafterSide alone: paths are never opened."""
    return TrainConfig(
        model=ModelConfig(target_path=Path("unused")),
        drafter=DrafterConfig(mask_token_id=shape.vocab - 1, num_layers=shape.layers, block_size=shape.block),
        data=DataConfig(shards=Path("unused"), seq_len=shape.seq_len, max_anchors=shape.anchors),
        train=LoopConfig(
            gradient_checkpointing=variant.gradient_checkpointing,
            compile=variant.compile,
            dtype="bfloat16" if device.type == "cuda" else "float32",
            device=device.type,
            loss_chunk=variant.loss_chunk,
        ),
    )


def frozen_target_parts(
    shape: Shape, device: torch.device, dtype: torch.dtype
) -> tuple[nn.Embedding, nn.Linear]:
    embed = nn.Embedding(shape.vocab, shape.hidden, device=device, dtype=dtype)
    head = nn.Linear(shape.hidden, shape.vocab, bias=False, device=device, dtype=dtype)
    with torch.no_grad():
        embed.weight.normal_(0.0, 0.02)
        head.weight.normal_(0.0, 0.02)
    embed.requires_grad_(False)
    head.requires_grad_(False)
    return embed, head


def random_batch(shape: Shape, spec: DrafterSpec, device: torch.device, dtype: torch.dtype) -> TargetBatch:
    """Every token supervised, so each sequence gets its full `anchors` blocks."""
    gen = torch.Generator(device=device).manual_seed(0)
    b, t, k = shape.batch, shape.seq_len, len(spec.target_layer_ids)
    ids = torch.randint(0, shape.vocab - 1, (b, t), generator=gen, device=device)
    context = torch.randn(b, t, k * shape.hidden, generator=gen, device=device, dtype=dtype)
    return TargetBatch(input_ids=ids, loss_mask=torch.ones_like(ids, dtype=torch.bool), context=context)


# ---- FLOP accounting ----


def attention_pairs(
    shape: Shape, spec: DrafterSpec, impl: str, device: torch.device
) -> dict[str, dict[str, int]]:
    """Per layer type: visible (query, key) pairs and pairs the kernel computes, for one anchor sample."""
    loss_mask = torch.ones(shape.batch, shape.seq_len, dtype=torch.bool)
    anchors, valid = sample_anchors(loss_mask, shape.anchors, shape.block, torch.Generator().manual_seed(1))
    anchors, valid = anchors.to(device), valid.to(device)
    n, t = anchors.shape[1] * shape.block, shape.seq_len
    out = {}
    for layer_type in set(spec.layer_types):
        window = spec.sliding_window if layer_type == SLIDING else None
        visible = int(block_attention_mask(anchors, valid, t, shape.block, window).sum())
        if impl == "flex":
            tiles = flex_block_mask(anchors, valid, t, shape.block, window).to_dense()[:, 0].bool()
            q_sizes = (n - torch.arange(tiles.shape[1], device=device) * FLEX_TILE).clamp(max=FLEX_TILE)
            k_sizes = (t + n - torch.arange(tiles.shape[2], device=device) * FLEX_TILE).clamp(max=FLEX_TILE)
            computed = int((tiles * q_sizes[None, :, None] * k_sizes[None, None, :]).sum())
        else:
            computed = shape.batch * n * (t + n)
        out[layer_type] = {"visible": visible, "computed": computed}
    return out


def step_flops(
    shape: Shape, spec: DrafterSpec, variant: Variant, pairs: dict[str, dict[str, int]], supervised: int
) -> dict[str, float]:
    h, d, b, t = shape.hidden, shape.head_dim, shape.batch, shape.seq_len
    n = shape.anchors * shape.block
    q_o = 2 * h * shape.heads * d
    k_v = 2 * h * shape.kv_heads * d
    mlp = 3 * h * shape.ffn
    layer_fwd = 2 * (b * n * (q_o + mlp) + b * (t + n) * k_v)
    fc_params = len(spec.target_layer_ids) * h * h
    head_fwd = 2 * h * shape.vocab * supervised
    per_pair = 4 * d * shape.heads  # forward FLOPs of one (query, key) pair over all heads
    visible = sum(pairs[lt]["visible"] for lt in spec.layer_types)
    computed = sum(pairs[lt]["computed"] for lt in spec.layer_types)
    linear = 3 * layer_fwd * shape.layers
    attn_needed = 3 * per_pair * visible
    model = linear + 4 * fc_params * b * t + attn_needed + 2 * head_fwd
    # The LM head's executed cost: logits and the input gradient (fused), plus the logits again in backward
    # (checkpointed).
    head_passes = 3 if variant.loss == "checkpointed" else 2
    executed = linear + 4 * fc_params * b * t + 3.5 * per_pair * computed + head_passes * head_fwd
    if variant.gradient_checkpointing:
        executed += layer_fwd * shape.layers + per_pair * computed
    return {
        "model": model,
        "executed": executed,
        "brief_6x": linear + 6 * fc_params * b * t + attn_needed + 3 * head_fwd,
        "drafter_linear": linear,
        "attention_needed": attn_needed,
        "attention_computed": 3.5 * per_pair * computed,
        "lm_head": 2 * head_fwd,
        "fc": 4 * fc_params * b * t,
    }


# ---- timing ----


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(fn: Callable[[], Any], repeats: int, device: torch.device) -> list[float]:
    """Seconds per call: CUDA events on GPU (each bracketing one call), perf_counter on CPU."""
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return times


def matmul_rate(device: torch.device) -> float:
    """FLOP/s of a square matmul: 8192^3 bf16 on CUDA, 512^3 fp32 on CPU."""
    n, dtype = (8192, torch.bfloat16) if device.type == "cuda" else (512, torch.float32)
    a = torch.randn(n, n, device=device, dtype=dtype)
    bm = torch.randn(n, n, device=device, dtype=dtype)
    time_calls(lambda: a @ bm, 3, device)
    return 2 * n**3 / statistics.median(time_calls(lambda: a @ bm, 20, device))


def dynamo_graphs() -> int:
    try:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])
    except Exception:  # private API; absence only loses a diagnostic
        return -1


def bench_config(
    shape: Shape,
    variant: Variant,
    device: torch.device,
    args: argparse.Namespace,
    rates: dict[str, float | None],
) -> dict[str, Any]:
    spec = drafter_spec(shape)
    cfg = train_config(shape, variant, device)
    # Frozen target parts in the target's serving dtype; fp32 on CPU where the trainer runs without autocast.
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    drafter = prepare_drafter(DFlashDrafter(spec, attention=variant.attention).to(device), cfg)
    embed, head = frozen_target_parts(shape, device, dtype)
    batch = random_batch(shape, spec, device, dtype)
    parts = SimpleNamespace(embed_tokens=embed, lm_head=head)
    side = DrafterSide(
        cfg, parts, Horizon(args.warmup + args.steps, "steps"), device=device, save=False, drafter=drafter
    )
    side.objective = dataclasses.replace(side.objective, loss_impl=variant.loss)

    def step() -> Any:
        side.step(0, 0, batch)  # item 0 every time: the same anchors, a steady workload
        return side.last

    impl = resolve_impl(variant.attention, device)

    t0 = time.perf_counter()
    for _ in range(args.warmup):
        step()
    sync(device)
    warmup_s = time.perf_counter() - t0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    graphs = dynamo_graphs()
    metrics = []
    times = time_calls(lambda: metrics.append(step()), args.steps, device)
    graphs_during = dynamo_graphs() - graphs if graphs >= 0 else -1
    step_s = statistics.median(times)
    supervised = metrics[-1].num_tokens
    pairs = attention_pairs(shape, spec, impl, device)
    flops = step_flops(shape, spec, variant, pairs, supervised)
    row: dict[str, Any] = {
        "shape": dataclasses.asdict(shape),
        "variant": dataclasses.asdict(variant) | {"attention_impl": impl},
        "drafter_params": sum(p.numel() for p in drafter.parameters()),
        "step_s_median": step_s,
        "step_s_all": times,
        "warmup_s": warmup_s,
        "supervised_tokens": supervised,
        "supervised_tokens_per_s": supervised / step_s,
        "context_tokens_per_s": shape.batch * shape.seq_len / step_s,
        "flops": flops,
        "attention_pairs": pairs,
        "tflops_model": flops["model"] / step_s / 1e12,
        "loss_last": metrics[-1].loss,
        "dynamo_graphs_during_timing": graphs_during,
        # The chunked loss holds at most one chunk of fp32 logits (the unchunked loss would hold P of them).
        "logits_chunk_gib": variant.loss_chunk * shape.vocab * 4 / 2**30,
        "logits_unchunked_gib": supervised * shape.vocab * 4 / 2**30,
    }
    for name, rate in rates.items():
        if rate:
            row[f"mfu_vs_{name}"] = flops["model"] / step_s / rate
            row[f"hfu_vs_{name}"] = flops["executed"] / step_s / rate
            row[f"mfu_6x_vs_{name}"] = flops["brief_6x"] / step_s / rate
    if device.type == "cuda":
        row["peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        row["peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / 2**30
        row["mask_build_ms"] = mask_build_ms(shape, spec, impl, device)
    if getattr(args, "profile", 0):  # bench_specforge passes its own arguments
        row["profile"] = profile_steps(step, args.profile, device)
    return row


KERNEL_KINDS = (  # the first pattern that matches a kernel's name gives its kind
    ("gemm", re.compile(r"gemm|cutlass|xmma|nvjet|cublas|matmul|mm_", re.I)),
    ("attention (flex)", re.compile(r"flex|attention|tem_fused", re.I)),
    ("optimizer", re.compile(r"adam|multi_tensor|foreach", re.I)),
    ("copy, cast", re.compile(r"copy|convert|cast|memcpy|memset", re.I)),
    ("reduction, norm", re.compile(r"reduce|norm|red_fused|per_fused", re.I)),
    ("elementwise", re.compile(r"elementwise|poi_fused|vectorized|unrolled", re.I)),
)


def profile_steps(step: Callable[[], Any], steps: int, device: torch.device) -> dict[str, Any]:
    """Where a step's device time goes: `steps` steps under torch.profiler, kernels grouped by kind, the top
    kernels by time, and the device's idle share (the step's wall time that no kernel covered)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        sync(device)
    wall_us = (time.perf_counter() - t0) * 1e6
    kernels: dict[str, float] = {}
    for event in prof.key_averages():
        us = getattr(event, "device_time_total", 0.0) or getattr(event, "cuda_time_total", 0.0)
        # record_function ranges ("Optimizer.step#AdamW.step") carry device time: their kernels count already
        if getattr(event, "is_user_annotation", False) or "#" in event.key:
            continue
        if us and "CUDA" in str(getattr(event, "device_type", "")):  # kernels, not the ops that launch them
            kernels[event.key] = kernels.get(event.key, 0.0) + us
    busy = sum(kernels.values())
    kinds: dict[str, float] = {}
    for name, us in kernels.items():
        kind = next((k for k, pattern in KERNEL_KINDS if pattern.search(name)), "other")
        kinds[kind] = kinds.get(kind, 0.0) + us
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:15]
    return {
        "steps": steps,
        "wall_ms_per_step": wall_us / steps / 1e3,
        "device_busy_share": busy / wall_us if wall_us else float("nan"),
        "kinds_ms_per_step": {k: us / steps / 1e3 for k, us in sorted(kinds.items(), key=lambda kv: -kv[1])},
        "top_kernels_ms_per_step": [[name[:120], us / steps / 1e3] for name, us in top],
    }


def mask_build_ms(shape: Shape, spec: DrafterSpec, impl: str, device: torch.device) -> float:
    """Milliseconds to build the masks of one step (inside the step time already; shown to locate cost)."""
    from dflash_trainer.model.attention import build_masks

    anchors, valid = sample_anchors(
        torch.ones(shape.batch, shape.seq_len, dtype=torch.bool),
        shape.anchors,
        shape.block,
        torch.Generator(),
    )
    anchors, valid = anchors.to(device), valid.to(device)

    def build() -> None:
        build_masks(
            impl,
            set(spec.layer_types),
            anchors,
            valid,
            shape.seq_len,
            shape.block,
            spec.sliding_window,
            SLIDING,
        )

    time_calls(build, 2, device)
    return 1e3 * statistics.median(time_calls(build, 5, device))


# ---- correctness of the fast path on this device ----


def check_flex_against_dense(device: torch.device) -> dict[str, Any]:
    """flex vs dense on a mid-size drafter in fp32: outputs and all gradients (sliding, full, padding)."""
    spec = DrafterSpec(
        hidden_size=256, intermediate_size=512, num_layers=2, num_attention_heads=8, num_key_value_heads=2,
        head_dim=32, vocab_size=1024, num_target_layers=8, target_layer_ids=[1, 5], block_size=16,
        mask_token_id=1023, layer_types=[SLIDING, FULL], sliding_window=96,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    t = 300
    mask = torch.ones(2, t, dtype=torch.bool)
    mask[1, 20:] = False  # the second sequence has 18 eligible anchors: 6 padding blocks
    anchors, valid = sample_anchors(mask, 24, 16, gen)
    context = torch.randn(2, t, 2 * spec.hidden_size, generator=gen).to(device)
    noise = torch.randn(2, anchors.shape[1] * 16, spec.hidden_size, generator=gen).to(device)
    results = []
    for attention in ("dense", "flex"):
        torch.manual_seed(0)
        drafter = DFlashDrafter(spec, attention=attention).to(device).train()
        out = drafter.forward_blocks(context, noise, anchors.to(device), valid.to(device))
        (out * torch.linspace(-1, 1, out.shape[-1], device=device)).sum().backward()
        results.append((out.detach(), {k: p.grad.clone() for k, p in drafter.named_parameters()}))
    (dense, dense_g), (flex, flex_g) = results

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))

    out_err = rel(flex, dense)
    grad_err = max(rel(flex_g[k], g) for k, g in dense_g.items())
    return {
        "invalid_blocks": int((~valid).sum()),
        "max_rel_err_output": out_err,
        "max_rel_err_grad": grad_err,
        "ok": out_err < 1e-4 and grad_err < 1e-3,
    }


# ---- driver ----


def fmt(value: Any, spec: str) -> str:
    return format(value, spec) if isinstance(value, int | float) and not math.isnan(value) else "n/a"


def table(rows: list[dict[str, Any]], rate_names: list[str]) -> str:
    head = [
        "hidden",
        "layers",
        "attn",
        "ckpt",
        "loss",
        "step ms",
        "sup tok/s",
        "ctx tok/s",
        "TFLOP/s",
        "peak GiB",
    ]
    head += [f"MFU/{n}" for n in rate_names] + [f"HFU/{n}" for n in rate_names] + [f"6x/{rate_names[0]}"]
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['shape']['hidden']} | {r['shape']['layers']} | {r['variant']['attention']} | "
                         f"error: {r['error'][:80]}")  # fmt: skip
            continue
        cells = [
            str(r["shape"]["hidden"]),
            str(r["shape"]["layers"]),
            r["variant"]["attention_impl"],
            "on" if r["variant"]["gradient_checkpointing"] else "off",
            r["variant"].get("loss", "checkpointed"),
            fmt(1e3 * r["step_s_median"], ".1f"),
            fmt(r["supervised_tokens_per_s"], ",.0f"),
            fmt(r["context_tokens_per_s"], ",.0f"),
            fmt(r["tflops_model"], ".3g"),
            fmt(r.get("peak_allocated_gib", float("nan")), ".1f"),
        ]
        cells += [fmt(100 * r.get(f"mfu_vs_{n}", float("nan")), ".1f") + "%" for n in rate_names]
        cells += [fmt(100 * r.get(f"hfu_vs_{n}", float("nan")), ".1f") + "%" for n in rate_names]
        cells += [fmt(100 * r.get(f"mfu_6x_vs_{rate_names[0]}", float("nan")), ".1f") + "%"]
        lines.append(" | ".join(cells))
    return "\n".join(lines)


def variants(args: argparse.Namespace, device: torch.device) -> list[tuple[int, int, Variant]]:
    compile_ = args.compile if args.compile is not None else device.type == "cuda"
    base = Variant(args.attention, compile_, args.gradient_checkpointing, args.loss_chunk, args.loss[0])
    runs = [(h, n, base) for h in args.hidden for n in args.layers]
    # Further loss implementations side by side on the largest shape, in the same run.
    runs += [(max(args.hidden), max(args.layers), dataclasses.replace(base, loss=x)) for x in args.loss[1:]]
    if args.extras:
        h, n = max(args.hidden), max(args.layers)
        runs.append((h, n, dataclasses.replace(base, gradient_checkpointing=not base.gradient_checkpointing)))
        runs.append((h, min(args.layers), dataclasses.replace(base, attention="dense")))
    return runs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    p.add_argument("--tiny", action=argparse.BooleanOptionalAction, default=None, help="default: on CPU")
    p.add_argument("--hidden", type=int, nargs="+", help="default 4096 5120 (tiny: 128 160)")
    p.add_argument("--layers", type=int, nargs="+", default=[1, 5])
    p.add_argument("--seq-len", type=int, default=3072)
    p.add_argument("--anchors", type=int, default=512)
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--vocab", type=int, default=248320)
    p.add_argument("--batch", type=int, default=1, help="sequences per step")
    p.add_argument("--attention", choices=["auto", "flex", "dense"], default="auto")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None, help="default: on CUDA")
    p.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--loss-chunk", type=int, default=2048)
    losses = "loss implementations: the first for every shape, the others on the largest (side by side)"
    p.add_argument("--loss", nargs="+", choices=list(LOSS_IMPLS), default=["fused"], help=losses)
    extras = "also the largest shape with checkpointing flipped, and dense attention (default: on CUDA)"
    p.add_argument("--extras", action=argparse.BooleanOptionalAction, default=None, help=extras)
    check = "first compare flex with dense (outputs, gradients) on this device (CUDA only)"
    p.add_argument("--check", action=argparse.BooleanOptionalAction, default=True, help=check)
    p.add_argument("--warmup", type=int, help="untimed steps (compilation happens here); default 3, CPU 1")
    p.add_argument("--steps", type=int, help="timed steps, the median is reported; default 10, CPU 3")
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="after timing, N steps under torch.profiler: device time by kernel kind, idle share",
    )
    args = p.parse_args(argv)
    cpu = args.device == "cpu"
    args.tiny = cpu if args.tiny is None else args.tiny
    args.extras = not cpu if args.extras is None else args.extras
    args.warmup = args.warmup if args.warmup is not None else (1 if cpu else 3)
    args.steps = args.steps or (3 if cpu else 10)
    args.hidden = args.hidden or ([64, 96] if args.tiny else [4096, 5120])
    return args


def environment(device: torch.device) -> dict[str, Any]:
    import transformers

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    else:
        env["cpu_threads"] = torch.get_num_threads()
    return env


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)  # shared cores: more threads only contend
    shape_of = tiny_shape if args.tiny else reference_shape
    rates: dict[str, float | None] = {"matmul": matmul_rate(device)}
    if device.type == "cuda":
        rates = {"peak": H100_BF16_DENSE_PEAK, **rates}
    result: dict[str, Any] = {
        "command": " ".join(["python3", *sys.argv]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "environment": environment(device),
        "rates_flops": rates,
        "check": check_flex_against_dense(device) if args.check and device.type == "cuda" else None,
        "rows": [],
    }
    print(f"matmul rate: {rates['matmul'] / 1e12:.3g} TFLOP/s; check: {result['check']}", flush=True)
    for hidden, layers, variant in variants(args, device):
        shape = shape_of(hidden, layers, args)
        try:
            row = bench_config(shape, variant, device, args, rates)
        except Exception as exc:  # one failing shape (OOM) must not lose the others
            row = {
                "shape": dataclasses.asdict(shape),
                "variant": dataclasses.asdict(variant),
                "error": repr(exc),
            }
        result["rows"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("step_s_all", "flops")}), flush=True)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=1))
        release(device)
    print()
    print(table(result["rows"], list(rates)))
    return 0 if result["check"] is None or result["check"]["ok"] else 1


def release(device: torch.device) -> None:
    """Free one configuration before the next: memory, and compiled graphs whose shapes would not recur."""
    gc.collect()
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
