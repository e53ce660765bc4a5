"""Our drafter step against SpecForge's: same GPU, same shape, same inputs, one run (docs/benchmarks.md).

    python3 trainer/bench/bench_specforge.py --device cuda --out $OUT/specforge.json   # one H200
    python3 trainer/bench/bench_specforge.py --device cpu                       # tiny shapes, any machine

SpecForge is installed without its serving dependencies (`pip install --no-deps specforge==0.2.0`: sglang,
datasets and wandb are not imported by the two modules used here). Its DFlash step as shipped:
`OnlineDFlashModel` over `DFlashDraftModel` (specforge/algorithms/common/dflash_family_model.py,
specforge/modeling/draft/dflash.py), attention backend `flex_attention` on CUDA (`sdpa` on a CPU), fp32
master weights under bf16 autocast, fused AdamW. Ours: `DrafterSide.step` as the trainer runs it
(bench_drafter.py's default variant). Both get the same random context features [B, T, K*H], the same
frozen bf16 embedding and LM head, every token supervised, 512 anchors of 16. Each side: warm-up steps
(compilation), then the median of timed steps (CUDA events) and the peak memory of the timed steps; the
ratio is printed and written with the figures.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_drafter as bd  # the shapes, inputs and timing of our own benchmark
import torch


def specforge_model(shape: bd.Shape, spec: Any, parts: SimpleNamespace, device: torch.device, backend: str):
    """SpecForge's draft model and its training wrapper at `shape`; the draft in fp32 (master weights)."""
    from specforge.algorithms.common.dflash_family_model import OnlineDFlashModel
    from specforge.modeling.draft.dflash import DFlashDraftModel
    from transformers import Qwen3Config

    config = Qwen3Config(
        hidden_size=shape.hidden,
        intermediate_size=shape.ffn,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        vocab_size=shape.vocab,
        max_position_embeddings=max(40960, 2 * shape.seq_len),
        rms_norm_eps=1e-6,
        layer_types=list(spec.layer_types),
        use_sliding_window=spec.sliding_window is not None,
        sliding_window=spec.sliding_window,
        tie_word_embeddings=False,
    )
    config.num_target_layers = spec.num_target_layers
    config.block_size = shape.block
    config.dflash_config = {
        "mask_token_id": spec.mask_token_id,
        "target_layer_ids": list(spec.target_layer_ids),
    }
    config._attn_implementation = backend
    draft = DFlashDraftModel(config).to(device=device, dtype=torch.float32)
    model = OnlineDFlashModel(
        draft,
        parts.lm_head,
        parts.embed_tokens,
        mask_token_id=spec.mask_token_id,
        block_size=shape.block,
        attention_backend=backend,
        num_anchors=shape.anchors,
    )
    return draft, model


def measure(step, device: torch.device, warmup: int, steps: int) -> dict[str, float]:
    t0 = time.perf_counter()
    for _ in range(warmup):
        step()
    bd.sync(device)
    warmup_s = time.perf_counter() - t0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = bd.time_calls(step, steps, device)
    out = {"step_ms_median": 1e3 * statistics.median(times), "warmup_s": warmup_s}
    if device.type == "cuda":
        out["peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", type=Path)
    p.add_argument("--hidden", type=int, default=None, help="default 5120 (CPU: 64)")
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--seq-len", type=int, default=3072)
    p.add_argument("--anchors", type=int, default=512)
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--vocab", type=int, default=248320)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--warmup", type=int, default=None, help="default 3 (CPU 1)")
    p.add_argument("--steps", type=int, default=None, help="default 10 (CPU 2)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    cpu = device.type == "cpu"
    args.warmup = args.warmup if args.warmup is not None else (1 if cpu else 3)
    args.steps = args.steps or (2 if cpu else 10)
    hidden = args.hidden or (64 if cpu else 5120)
    shape = (bd.tiny_shape if cpu else bd.reference_shape)(hidden, args.layers, args)
    spec = bd.drafter_spec(shape)
    dtype = torch.float32 if cpu else torch.bfloat16
    embed, head = bd.frozen_target_parts(shape, device, dtype)
    parts = SimpleNamespace(embed_tokens=embed, lm_head=head)
    batch = bd.random_batch(shape, spec, device, dtype)
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16) if not cpu else torch.autocast("cpu", enabled=False)
    )
    result: dict[str, Any] = {
        "command": " ".join(["python3", *sys.argv]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "environment": bd.environment(device),
        "shape": bd.dataclasses.asdict(shape),
    }

    # Ours: the trainer's own step, the default variant of bench_drafter (compiled layers on CUDA).
    args_ours = SimpleNamespace(warmup=args.warmup, steps=args.steps)
    variant = bd.Variant("auto", not cpu, False, 2048)
    rates = {"matmul": bd.matmul_rate(device)}
    ours = bd.bench_config(shape, variant, device, args_ours, rates)
    result["ours"] = {
        "step_ms_median": 1e3 * ours["step_s_median"],
        "warmup_s": ours["warmup_s"],
        "peak_allocated_gib": ours.get("peak_allocated_gib"),
        "loss_last": ours["loss_last"],
    }
    print(f"ours: {json.dumps(result['ours'])}", flush=True)
    bd.release(device)
    gc.collect()

    try:
        backend = "sdpa" if cpu else "flex_attention"
        draft, model = specforge_model(shape, spec, parts, device, backend)
    except ImportError as e:
        result["specforge"] = {"error": f"not installed: {e}"}
        print(f"specforge: not installed ({e}); pip install --no-deps specforge==0.2.0", flush=True)
    else:
        opt = torch.optim.AdamW(draft.parameters(), lr=1e-4, fused=not cpu)

        def step() -> None:
            with autocast:
                loss, _accuracy, _metrics = model(batch.input_ids, batch.context, batch.loss_mask.float())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        theirs = measure(step, device, args.warmup, args.steps)
        from importlib.metadata import version

        result["specforge"] = theirs | {"version": version("specforge"), "attention_backend": backend}
        result["specforge_over_ours"] = theirs["step_ms_median"] / result["ours"]["step_ms_median"]
        print(f"specforge: {json.dumps(result['specforge'])}", flush=True)
        print(f"SpecForge step / our step: {result['specforge_over_ours']:.2f}x", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
