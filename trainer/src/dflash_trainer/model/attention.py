"""Attention of the drafter's training forward: block queries over [context ; blocks] keys.

Two implementations of one visibility rule (method.mask.block_attention_mask):

- "dense": SDPA under the Bool[B, N, T+N] mask. The reference; runs anywhere. With 512 blocks of 16 and a
  3072-token context it scores every query against all 11264 keys although a query sees about half the
  context and 16 block keys (~7x the needed attention FLOPs), and a masked GQA SDPA is not served by the
  flash kernel.
- "flex": FlexAttention with a block-sparse mask computed from the anchors (no [N, T+N] tensor). Tiles of
  128x128 that no query of the tile may see are skipped, so the work is the visible keys plus the partial
  tiles on the diagonal of the block part. Compiled on CUDA; PyTorch has no FlexAttention backward on
  CPU, so CPU training uses "dense".

"auto" picks flex on CUDA and dense elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from dflash_trainer.method.mask import block_attention_mask, tile_visibility, visible_key_intervals

AttentionImpl = Literal["auto", "flex", "dense"]
Mask = torch.Tensor | BlockMask
MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

# One compiled kernel for every layer and step; dynamic=False: training shapes repeat (512 anchors x 16).
_compiled_flex: Callable[..., torch.Tensor] | None = None


def resolve_impl(impl: AttentionImpl, device: torch.device) -> Literal["flex", "dense"]:
    if impl == "auto":
        return "flex" if device.type == "cuda" else "dense"
    return impl


def block_mask_mod(
    anchors: torch.Tensor, valid: torch.Tensor, ctx_len: int, block_size: int, sliding_window: int | None
) -> MaskMod:
    """mask_mod(b, h, q, kv) -> visible, the rule of block_attention_mask from indices alone.

    Query q is slot q % Bs of block q // Bs at position anchor + q % Bs. Key kv < ctx_len is context
    position kv: visible before the anchor (and inside the window), only for valid blocks. Key kv >= ctx_len
    is slot (kv - ctx_len) % Bs of block (kv - ctx_len) // Bs: visible only inside the query's own block.
    """
    bs = block_size

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        blk = q // bs
        anchor = anchors[b, blk]
        in_ctx = kv < ctx_len
        see_ctx = in_ctx & (kv < anchor) & valid[b, blk]
        rel = kv - ctx_len
        see_blk = ~in_ctx & (rel // bs == blk)
        if sliding_window is not None:
            see_ctx = see_ctx & (anchor + q % bs - kv < sliding_window)
            see_blk = see_blk & (torch.abs(rel % bs - q % bs) < sliding_window)
        return see_ctx | see_blk

    return mask_mod


def flex_block_mask(
    anchors: torch.Tensor,
    valid: torch.Tensor,
    ctx_len: int,
    block_size: int,
    sliding_window: int | None,
    *,
    tile: int = 128,
) -> BlockMask:
    """The BlockMask of one layer type (heads share it: H=None); `tile` is the kernel's sparsity unit.

    Built from each query row's visible key intervals: the same tensors as create_block_mask(mask_mod), which
    evaluates mask_mod on all N x (T+N) pairs (17 ms a step for two layer types at the reference shape on an
    H200; docs/journal.md) where this does N x (key tiles). test_model_attention_paths compares the two.
    """
    num = anchors.shape[1]
    n = num * block_size
    intervals = visible_key_intervals(anchors, valid, ctx_len, block_size, sliding_window)
    partial, full = tile_visibility(intervals, ctx_len + n, tile)
    mod = block_mask_mod(anchors, valid, ctx_len, block_size, sliding_window)
    return BlockMask.from_kv_blocks(
        *_ordered(partial),
        *_ordered(full),
        BLOCK_SIZE=(tile, tile),
        mask_mod=mod,
        seq_lengths=(n, ctx_len + n),
    )


def _ordered(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Bool[B, Qt, Kt] -> (count, kv tile indices) per query tile, kept ones first in ascending order, with a
    heads dimension of 1: the layout create_block_mask hands from_kv_blocks (its _dense_to_ordered)."""
    dense = tiles[:, None].to(torch.int32)
    count = dense.sum(dim=-1, dtype=torch.int32)
    indices = torch.argsort(dense, dim=-1, descending=True, stable=True).to(torch.int32)
    return count, indices


def build_masks(
    impl: Literal["flex", "dense"],
    layer_types: set[str],
    anchors: torch.Tensor,
    valid: torch.Tensor,
    ctx_len: int,
    block_size: int,
    sliding_window: int | None,
    sliding_name: str,
) -> dict[str, Mask]:
    """One mask per layer type; the window applies to the layer type named `sliding_name`."""
    build = flex_block_mask if impl == "flex" else block_attention_mask
    return {
        t: build(anchors, valid, ctx_len, block_size, sliding_window if t == sliding_name else None)
        for t in layer_types
    }


def _flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockMask) -> torch.Tensor:
    global _compiled_flex
    if q.device.type != "cuda" or torch.compiler.is_compiling():
        # Inside a compiled layer dynamo traces flex itself; on CPU only the eager forward exists.
        return flex_attention(q, k, v, block_mask=mask, enable_gqa=True)
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex(q, k, v, block_mask=mask, enable_gqa=True)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v over visible keys; q [B,Hq,N,d], k/v [B,Hkv,T+N,d] (GQA)."""
    if isinstance(mask, BlockMask):
        # Under autocast q/k come out of fp32 norms and rope while v is bf16; flex wants one dtype
        # (SDPA gets the same cast from autocast).
        return _flex(q.to(v.dtype), k.to(v.dtype), v, mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1), enable_gqa=True)
