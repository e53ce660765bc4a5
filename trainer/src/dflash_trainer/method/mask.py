"""The training attention mask: all blocks of a sequence in one forward."""

from __future__ import annotations

import torch


def block_attention_mask(
    anchors: torch.Tensor,
    valid: torch.Tensor,
    ctx_len: int,
    block_size: int,
    sliding_window: int | None,
) -> torch.Tensor:
    """Bool[B, A*Bs, ctx_len + A*Bs]; True = may attend. Keys are [context ; blocks].

    A block sees the target features strictly before its anchor (the anchor's own feature does not exist
    yet at serving time) and its own block in both directions, never another block. A sliding-window layer
    also drops keys whose position differs from the query's by `sliding_window` or more, in both directions,
    which is what dflash's `_attention_mask` does for a non-causal sliding layer.
    """
    batch, num = anchors.shape
    device = anchors.device
    offsets = torch.arange(block_size, device=device)
    q_pos = (anchors[:, :, None] + offsets).flatten(1)  # [B, N]
    q_anchor = anchors[:, :, None].expand(batch, num, block_size).flatten(1)
    q_block = torch.arange(num, device=device)[:, None].expand(num, block_size).flatten()

    ctx_pos = torch.arange(ctx_len, device=device)
    ctx_visible = ctx_pos[None, None, :] < q_anchor[:, :, None]  # [B, N, T]
    own_block = q_block[:, None] == q_block[None, :]  # [N, N]
    blk_visible = own_block[None].expand(batch, -1, -1)

    if sliding_window is not None:
        ctx_visible = ctx_visible & (q_pos[:, :, None] - ctx_pos[None, None, :] < sliding_window)
        diff = q_pos[:, :, None] - q_pos[:, None, :]
        blk_visible = blk_visible & (diff.abs() < sliding_window)
    # Invalid blocks read no context; every row still sees its own block, so none is empty (SDPA -> NaN).
    ctx_visible = ctx_visible & valid[:, :, None].expand(batch, num, block_size).flatten(1)[:, :, None]
    return torch.cat([ctx_visible, blk_visible], dim=2)
