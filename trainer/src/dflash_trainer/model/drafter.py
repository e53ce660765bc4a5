"""The DFlash drafter: Qwen3-style layers with KV injection of fused target features.

It computes what dflash's `DFlashDraftModel` serves, with the same parameter names, but runs every
block of a sequence in one forward under the block attention mask (model.attention: block-sparse
FlexAttention on CUDA, masked SDPA as the reference).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half

from dflash_trainer.method.blocks import block_positions
from dflash_trainer.method.layers import target_layer_ids as default_target_layer_ids
from dflash_trainer.model.attention import AttentionImpl, Mask, attend, build_masks, resolve_impl

FULL = "full_attention"
SLIDING = "sliding_attention"


@dataclass
class DrafterSpec:
    """Shape and method settings of a drafter; everything the exported config.json needs."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's: serving builds logits with the target's head
    num_target_layers: int
    target_layer_ids: list[int]
    block_size: int
    mask_token_id: int
    layer_types: list[str]
    sliding_window: int | None = None
    rms_norm_eps: float = 1e-6
    rope_parameters: dict[str, Any] = field(
        default_factory=lambda: {"rope_type": "default", "rope_theta": 1e6}
    )
    max_position_embeddings: int = 32768
    hidden_act: str = "silu"
    initializer_range: float = 0.02

    def __post_init__(self) -> None:
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        if bad := set(self.layer_types) - {FULL, SLIDING}:
            raise ValueError(f"unknown layer types {sorted(bad)}")
        if SLIDING in self.layer_types and not self.sliding_window:
            raise ValueError("sliding_attention layers need sliding_window")
        if any(not 0 <= i < self.num_target_layers for i in self.target_layer_ids):
            raise ValueError(
                f"target_layer_ids {self.target_layer_ids} outside 0..{self.num_target_layers - 1}"
            )
        if "rope_theta" not in self.rope_parameters:
            raise ValueError("rope_parameters needs rope_theta")

    @classmethod
    def from_target_config(
        cls,
        target_cfg: Any,
        num_layers: int,
        block_size: int,
        mask_token_id: int,
        *,
        layer_types: list[str] | None = None,
        sliding_window: int | None = None,
        intermediate_size: int | None = None,
        target_layer_ids: list[int] | None = None,
        rope_theta: float | None = None,
    ) -> DrafterSpec:
        """Attention shape, norms, rope and vocab follow the target's (text) config.

        The target's rope is copied but reduced to its theta and type: the drafter applies plain
        full-head RoPE (dflash uses Qwen3RotaryEmbedding), so a partial or multimodal rope of the target
        does not carry over.
        """
        cfg = getattr(target_cfg, "text_config", None) or target_cfg
        rope = dict(getattr(cfg, "rope_parameters", None) or {})
        theta = float(rope_theta if rope_theta is not None else rope.get("rope_theta", 1e6))
        rope_params: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
        ids = target_layer_ids or default_target_layer_ids(cfg.num_hidden_layers, num_layers)
        return cls(
            hidden_size=cfg.hidden_size,
            intermediate_size=intermediate_size or cfg.intermediate_size,
            num_layers=num_layers,
            num_attention_heads=cfg.num_attention_heads,
            num_key_value_heads=cfg.num_key_value_heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
            vocab_size=cfg.vocab_size,
            num_target_layers=cfg.num_hidden_layers,
            target_layer_ids=list(ids),
            block_size=block_size,
            mask_token_id=mask_token_id,
            layer_types=list(layer_types or [FULL] * num_layers),
            sliding_window=sliding_window,
            rms_norm_eps=cfg.rms_norm_eps,
            rope_parameters=rope_params,
            max_position_embeddings=cfg.max_position_embeddings,
        )

    @classmethod
    def from_config_dict(cls, cfg: dict[str, Any]) -> DrafterSpec:
        """Inverse of config_dict (reads an exported config.json)."""
        dflash = cfg["dflash_config"]
        rope = cfg.get("rope_parameters") or {"rope_type": "default", "rope_theta": cfg["rope_theta"]}
        return cls(
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_attention_heads=cfg["num_attention_heads"],
            num_key_value_heads=cfg["num_key_value_heads"],
            head_dim=cfg["head_dim"],
            vocab_size=cfg["vocab_size"],
            num_target_layers=cfg["num_target_layers"],
            target_layer_ids=list(dflash["target_layer_ids"]),
            block_size=cfg["block_size"],
            mask_token_id=dflash["mask_token_id"],
            layer_types=list(cfg["layer_types"]),
            sliding_window=cfg.get("sliding_window"),
            rms_norm_eps=cfg["rms_norm_eps"],
            rope_parameters=dict(rope),
            max_position_embeddings=cfg["max_position_embeddings"],
            hidden_act=cfg.get("hidden_act", "silu"),
            initializer_range=cfg.get("initializer_range", 0.02),
        )

    def to_qwen3_config(self) -> Qwen3Config:
        """The Qwen3Config serving builds from the exported config.json (also feeds our rotary embedding)."""
        return Qwen3Config(**self.config_dict())

    def config_dict(self) -> dict[str, Any]:
        """The published draft-model config (model_type qwen3, architectures DFlashDraftModel)."""
        return {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": self.hidden_act,
            "rms_norm_eps": self.rms_norm_eps,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "initializer_range": self.initializer_range,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": False,
            # transformers 5 reads rope_parameters; older loaders read the top-level rope_theta.
            "rope_parameters": dict(self.rope_parameters),
            "rope_theta": self.rope_parameters["rope_theta"],
            "layer_types": list(self.layer_types),
            # Qwen3Config drops sliding_window unless use_sliding_window is set.
            "use_sliding_window": SLIDING in self.layer_types,
            "sliding_window": self.sliding_window,
            "max_window_layers": self.num_layers,
            # dflash treats sliding layers as causal unless told otherwise; DFlash blocks are bidirectional.
            "is_causal": False,
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "dflash_config": {
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": list(self.target_layer_ids),
            },
        }


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin


class DFlashAttention(nn.Module):
    """Queries from the block only; keys/values from [fused context ; block]; mask decides visibility."""

    def __init__(self, spec: DrafterSpec, cfg: Qwen3Config) -> None:
        super().__init__()
        h, d = spec.hidden_size, spec.head_dim
        self.head_dim = d
        self.q_proj = nn.Linear(h, spec.num_attention_heads * d, bias=False)
        self.k_proj = nn.Linear(h, spec.num_key_value_heads * d, bias=False)
        self.v_proj = nn.Linear(h, spec.num_key_value_heads * d, bias=False)
        self.o_proj = nn.Linear(spec.num_attention_heads * d, h, bias=False)
        self.q_norm = Qwen3RMSNorm(d, eps=spec.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(d, eps=spec.rms_norm_eps)

    def forward(
        self,
        block: torch.Tensor,
        context: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: Mask,
    ) -> torch.Tensor:
        bsz, n, _ = block.shape
        d = self.head_dim
        q = self.q_norm(self.q_proj(block).view(bsz, n, -1, d)).transpose(1, 2)
        kv_in = torch.cat([context, block], dim=1)
        k = self.k_norm(self.k_proj(kv_in).view(bsz, kv_in.shape[1], -1, d)).transpose(1, 2)
        v = self.v_proj(kv_in).view(bsz, kv_in.shape[1], -1, d).transpose(1, 2)
        cos, sin = (t.unsqueeze(1) for t in rope)  # [B,1,T+N,d]
        q = _rope(q, cos[:, :, -n:], sin[:, :, -n:])
        k = _rope(k, cos, sin)
        out = attend(q, k, v, mask)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, n, -1))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, spec: DrafterSpec, cfg: Qwen3Config, layer_type: str) -> None:
        super().__init__()
        self.layer_type = layer_type
        self.self_attn = DFlashAttention(spec, cfg)
        self.mlp = Qwen3MLP(cfg)
        self.input_layernorm = Qwen3RMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,
        context: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: Mask,
    ) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), context, rope, mask)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DFlashDrafter(nn.Module):
    """State dict names are the published format: layers.*, norm, fc, hidden_norm (no embedding, no head)."""

    def __init__(
        self, spec: DrafterSpec, *, gradient_checkpointing: bool = False, attention: AttentionImpl = "auto"
    ) -> None:
        super().__init__()
        self.spec = spec
        cfg = spec.to_qwen3_config()
        self.layers = nn.ModuleList(DFlashDecoderLayer(spec, cfg, t) for t in spec.layer_types)
        self.norm = Qwen3RMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(cfg)
        self.fc = nn.Linear(len(spec.target_layer_ids) * spec.hidden_size, spec.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)
        self.gradient_checkpointing = gradient_checkpointing
        self.attention: AttentionImpl = attention  # forward_blocks' implementation; "auto" = flex on CUDA
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Qwen3PreTrainedModel's init: normal(0, initializer_range) linears, unit norms."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                module.weight.normal_(0.0, self.spec.initializer_range)
            elif isinstance(module, Qwen3RMSNorm):
                module.weight.fill_(1.0)

    def forward(
        self,
        context: torch.Tensor,
        noise_embedding: torch.Tensor,
        positions: torch.Tensor,
        masks: dict[str, Mask],
    ) -> torch.Tensor:
        """Hidden states [B,N,H] of the block slots (after the final norm).

        context: raw target features [B,T,K*H]; noise_embedding: target embeddings of the block ids
        [B,N,H]; positions: Long[B,T+N] for context then block slots; masks per layer type: Bool[B,N,T+N]
        (dense SDPA) or a FlexAttention BlockMask over the same [N, T+N] (model.attention).
        """
        fused = self.hidden_norm(self.fc(context))
        rope = self.rotary_emb(noise_embedding, positions)
        hidden = noise_embedding
        for layer in self.layers:
            mask = masks[layer.layer_type]
            if self.gradient_checkpointing and self.training:
                hidden = checkpoint(layer, hidden, fused, rope, mask, use_reentrant=False)
            else:
                hidden = layer(hidden, fused, rope, mask)
        return self.norm(hidden)

    def forward_blocks(
        self,
        context: torch.Tensor,
        noise_embedding: torch.Tensor,
        anchors: torch.Tensor,
        valid: torch.Tensor,
    ) -> torch.Tensor:
        """Training forward: all blocks of each sequence at once, blocks laid out as method.blocks does."""
        bsz, ctx_len = context.shape[:2]
        bs = self.spec.block_size
        ctx_pos = torch.arange(ctx_len, device=context.device).expand(bsz, ctx_len)
        positions = torch.cat([ctx_pos, block_positions(anchors, bs)], dim=1)
        impl = resolve_impl(self.attention, context.device)
        layer_types = set(self.spec.layer_types)
        masks = build_masks(impl, layer_types, anchors, valid, ctx_len, bs, self.spec.sliding_window, SLIDING)
        return self.forward(context, noise_embedding, positions, masks)
