"""Write and check the published DFlash draft-model format (config.json + model.safetensors)."""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from dflash_trainer.model.drafter import DFlashDrafter, DrafterSpec

if TYPE_CHECKING:
    from dflash_trainer.config import TrainConfig

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def untrained_drafter(cfg: TrainConfig) -> DFlashDrafter:
    """The drafter a run of `cfg` starts from (step 0): its spec and seed; reads only the target config.

    A baseline: exported and served, it gives the acceptance length of a drafter that learnt nothing.
    """
    from dflash_trainer.model.target import read_text_config
    from dflash_trainer.train.setup import seeded_drafter

    return seeded_drafter(cfg, read_text_config(cfg.model.target_path)).to(torch.float32)


def expected_weight_names(spec: DrafterSpec) -> set[str]:
    with torch.device("meta"):
        return set(DFlashDrafter(spec).state_dict())


def export_draft(
    drafter_state: Mapping[str, torch.Tensor],
    spec: DrafterSpec,
    out_dir: str | Path,
    *,
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """Exactly the published weight names (no embedding, no head), cast to `dtype`, plus the config."""
    names = set(drafter_state)
    expected = expected_weight_names(spec)
    if names != expected:
        raise ValueError(
            f"drafter state does not match the format: extra {names - expected}, missing {expected - names}"
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in drafter_state.items()}
    save_file(tensors, out / WEIGHTS_NAME, metadata={"format": "pt"})
    config = spec.config_dict() | {"dtype": str(dtype).removeprefix("torch.")}
    (out / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    return out


def load_draft(out_dir: str | Path, *, device: str | torch.device = "cpu") -> DFlashDrafter:
    """Rebuild a drafter from an exported directory (weights keep the exported dtype)."""
    out = Path(out_dir)
    spec = DrafterSpec.from_config_dict(json.loads((out / CONFIG_NAME).read_text()))
    state = load_file(out / WEIGHTS_NAME, device=str(device))
    dtype = next(iter(state.values())).dtype
    drafter = DFlashDrafter(spec).to(device=device, dtype=dtype)
    drafter.load_state_dict(state, strict=True)
    return drafter.eval()


@torch.no_grad()
def check_export(
    out_dir: str | Path,
    drafter: DFlashDrafter,
    *,
    lm_head: nn.Linear | None = None,
    ctx_len: int = 12,
    seed: int = 0,
) -> float:
    """Max |difference| between the exported and the training drafter on one random block.

    Compares logits when `lm_head` is given, else the final hidden states. Both run in float32, so the
    result measures the export's rounding (bf16 export: ~1e-2) plus any format error (large).
    """
    exported = load_draft(out_dir, device=next(drafter.parameters()).device).float()
    spec = drafter.spec
    gen = torch.Generator().manual_seed(seed)
    device = next(drafter.parameters()).device
    context = torch.randn(1, ctx_len, len(spec.target_layer_ids) * spec.hidden_size, generator=gen).to(device)
    noise = torch.randn(1, spec.block_size, spec.hidden_size, generator=gen).to(device)
    anchors = torch.tensor([[ctx_len]], device=device)
    valid = torch.ones_like(anchors, dtype=torch.bool)
    reference = drafter if drafter.fc.weight.dtype == torch.float32 else copy.deepcopy(drafter).float()
    ours = reference.forward_blocks(context, noise, anchors, valid)
    theirs = exported.forward_blocks(context, noise, anchors, valid)
    if lm_head is not None:
        head = lm_head.weight.float()
        ours, theirs = ours @ head.t(), theirs @ head.t()
    return float((ours - theirs).abs().max())
