"""Random targets of published shapes, written in the published checkpoint layout, to rehearse a real run.

`dflash-train model random --shape qwen3.6-27b OUT` writes what the Qwen3.6-27B repository holds for the
trainer: config.json (the multimodal wrapper, model_type "qwen3_5", the text config under `text_config`),
sharded safetensors with the text model under `model.language_model.*`, the vision tower under
`model.visual.*`, `lm_head.weight`, `model.safetensors.index.json`, and a MANIFEST.json. The weights are
random (each module's own initialisation, seeded), built one module at a time on the GPU when there is one,
so the 54 GB target takes seconds to make and never needs the whole model in host memory at once.

Shape facts are those of the published config (hidden 5120, FFN 17408, 64 layers, full attention every 4th
layer with 24 query heads of 256 and 4 KV heads, Gated DeltaNet with 16 key / 48 value heads of 128 and conv
width 4, vocab 248320, partial rotary 0.25, rope theta 1e7). `--layers N` keeps the first N layers (the layer
pattern stays that of the full model) for a quicker rehearsal.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

GB = 1_000_000_000


@dataclass(frozen=True)
class Shape:
    text: dict[str, Any]
    vision: dict[str, Any] = field(default_factory=dict)
    shard_bytes: int = 5 * GB  # the published repositories shard at about 5 GB


def _qwen36_text(**over: Any) -> dict[str, Any]:
    text = {
        "vocab_size": 248320,
        "hidden_size": 5120,
        "intermediate_size": 17408,
        "num_hidden_layers": 64,
        "num_attention_heads": 24,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "attn_output_gate": True,
        "full_attention_interval": 4,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 48,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 262144,
        "tie_word_embeddings": False,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10_000_000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        },
    }
    return text | over


SHAPES: dict[str, Shape] = {
    "qwen3.6-27b": Shape(
        text=_qwen36_text(),
        # The published vision tower (27 blocks of 1152) projecting into the text model's 5120.
        vision={"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16,
                "out_hidden_size": 5120, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2},
    ),
    # The same structure at a size a CPU writes in a second: tests and the lab.
    "qwen3.6-mini": Shape(
        text=_qwen36_text(
            vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=6,
            linear_key_head_dim=16, linear_value_head_dim=16, max_position_embeddings=4096,
        ),
        vision={"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                "out_hidden_size": 64},
        shard_bytes=200_000,
    ),
}  # fmt: skip


def published_config(name: str, *, layers: int | None = None):
    """The wrapper config (Qwen3_5Config) of shape `name`, cut to its first `layers` layers."""
    from transformers import Qwen3_5Config

    if name not in SHAPES:
        raise ValueError(f"--shape {name!r}: known shapes are {', '.join(SHAPES)}")
    shape = SHAPES[name]
    text = dict(shape.text)
    full = text["num_hidden_layers"]
    interval = text.pop("full_attention_interval")
    text["layer_types"] = [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(full)
    ]
    if layers is not None:
        if not 1 <= layers <= full:
            raise ValueError(f"--layers {layers}: the {name} shape has 1..{full} layers")
        text["num_hidden_layers"] = layers
        text["layer_types"] = text["layer_types"][:layers]
    cfg = Qwen3_5Config(text_config=text, vision_config=shape.vision, tie_word_embeddings=False)
    cfg.architectures = ["Qwen3_5ForConditionalGeneration"]
    return cfg


_STACKS = ("model.language_model.layers", "model.visual.blocks")


def _units(model: nn.Module) -> list[tuple[str, nn.Module, bool]]:
    """(name, module, whole) built one at a time: each decoder layer and vision block whole, every other
    module holding tensors of its own with just those (whole=False)."""
    units = []
    for name, module in model.named_modules():
        parent = name.rsplit(".", 1)[0] if "." in name else ""
        if parent in _STACKS:
            units.append((name, module, True))
        elif name and not name.startswith(tuple(s + "." for s in _STACKS)) and _direct_keys(module):
            units.append((name, module, False))
    return units


def _direct_keys(module: nn.Module) -> list[str]:
    return [k for k in module.state_dict() if "." not in k]


def _plan_shards(sizes: list[tuple[str, int]], limit: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes:
        if shards[-1] and used + size > limit:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def write_random_target(
    out: str | Path,
    name: str,
    *,
    layers: int | None = None,
    device: str | torch.device | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    progress: Callable[[str], None] = print,
) -> Path:
    """Writes the random target; returns OUT. Refuses a non-empty OUT (nothing already there is touched)."""
    from safetensors.torch import save_file
    from transformers import Qwen3_5ForConditionalGeneration

    from dflash_trainer.manifest import write_manifest

    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out}: not empty; choose a new directory (nothing there was changed)")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cfg = published_config(name, layers=layers)
    with torch.device("meta"):
        model = Qwen3_5ForConditionalGeneration(cfg)
    units = {name: (module, whole) for name, module, whole in _units(model)}
    # Parameters and persistent buffers, in the order the units are built; sizes known from the meta model.
    owner: dict[str, str] = {}
    sizes: list[tuple[str, int]] = []
    for unit, (module, whole) in units.items():
        state = module.state_dict()
        for key in state if whole else _direct_keys(module):
            full = f"{unit}.{key}"
            owner[full] = unit
            sizes.append((full, state[key].numel() * dtype.itemsize))
    shards = _plan_shards(sizes, SHAPES[name].shard_bytes)
    total = sum(s for _, s in sizes)
    tmp = out.with_name(out.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    gen = torch.Generator(device=device)
    weight_map: dict[str, str] = {}
    built: dict[str, dict[str, torch.Tensor]] = {}
    for index, keys in enumerate(shards, 1):
        file = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        tensors: dict[str, torch.Tensor] = {}
        for key in keys:
            unit = owner[key]
            if unit not in built:
                module, whole = units[unit]
                built[unit] = _materialise(model, unit, module, whole, device, dtype, gen, seed)
            tensors[key] = built[unit].pop(key[len(unit) + 1 :]).to("cpu")
            if not built[unit]:
                del built[unit]
            weight_map[key] = file
        save_file(tensors, str(tmp / file), metadata={"format": "pt"})
        done = sum(s for k, s in sizes if k in weight_map)
        progress(
            f"model random: {file} ({done / GB:.1f} of {total / GB:.1f} GB, "
            f"{time.perf_counter() - start:.0f} s)"
        )
    index_doc = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index_doc, indent=2) + "\n")
    cfg.save_pretrained(str(tmp))
    write_manifest(tmp)
    if out.exists():
        out.rmdir()
    tmp.rename(out)  # complete or absent: a crash leaves OUT.partial, never a half-written OUT
    return out


def _materialise(
    model: nn.Module,
    unit: str,
    module: nn.Module,
    whole: bool,
    device: torch.device,
    dtype: torch.dtype,
    gen: torch.Generator,
    seed: int,
) -> dict[str, torch.Tensor]:
    """One unit on `device`, initialised by the model's own `_init_weights`, seeded by its name."""
    gen.manual_seed(seed * 1_000_003 + sum(unit.encode()))
    module.to_empty(device=device)
    with torch.no_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen, device=device)))
        for sub in module.modules():
            model._init_weights(sub)
    keep = None if whole else set(_direct_keys(module))
    state = {
        k: v.to(dtype) if v.is_floating_point() else v
        for k, v in module.state_dict().items()
        if keep is None or k in keep
    }
    module.to("meta")
    return state
