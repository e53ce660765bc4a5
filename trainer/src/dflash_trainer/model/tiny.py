"""Tiny random targets (a few hundred K parameters) written like real checkpoints, for tests and smoke runs.

Tokenizer-free: token ids are plain integers below TINY_VOCAB_SIZE. TINY_MASK_TOKEN_ID (the last id) is
reserved as the drafter's mask token; data for tiny targets must not use it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import (
    PreTrainedModel,
    Qwen3_5Config,
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

TINY_VOCAB_SIZE = 512
TINY_MASK_TOKEN_ID = TINY_VOCAB_SIZE - 1
TINY_KINDS = ("qwen3", "qwen3_5", "qwen3_5_vl_wrapper", "qwen3_next")


def tiny_token_ids(seed: int, shape: tuple[int, int] = (2, 24)) -> torch.Tensor:
    """Reproducible token ids for a tiny target, never the reserved mask token."""
    return torch.randint(0, TINY_MASK_TOKEN_ID, shape, generator=torch.Generator().manual_seed(seed))


_BASE: dict[str, Any] = {
    "vocab_size": TINY_VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}
_LINEAR: dict[str, Any] = {
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
}


def _build(kind: str) -> PreTrainedModel:
    if kind == "qwen3":
        return Qwen3ForCausalLM(
            Qwen3Config(**_BASE, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
        )
    if kind == "qwen3_5":
        return Qwen3_5ForCausalLM(Qwen3_5TextConfig(**_BASE, **_LINEAR))
    if kind == "qwen3_5_vl_wrapper":
        # The layout of the published Qwen3.5/3.6 27B checkpoints: text under model.language_model.*.
        vision = {
            "depth": 1,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "out_hidden_size": 64,
        }
        text = Qwen3_5TextConfig(**_BASE, **_LINEAR).to_dict()
        return Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision))
    if kind == "qwen3_next":
        moe = {"moe_intermediate_size": 32, "shared_expert_intermediate_size": 32}
        return Qwen3NextForCausalLM(
            Qwen3NextConfig(**_BASE, **_LINEAR, **moe, num_experts=4, num_experts_per_tok=2)
        )
    raise ValueError(f"unknown tiny target kind {kind!r}; choose from {TINY_KINDS}")


def write_tiny_target(out_dir: str | Path, *, kind: str = "qwen3_5", seed: int = 0) -> Path:
    """Write config.json + model.safetensors of a random target; the same seed gives the same weights."""
    out = Path(out_dir)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _build(kind)
    model.save_pretrained(out)
    return out
