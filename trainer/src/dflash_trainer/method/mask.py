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


def visible_key_intervals(
    anchors: torch.Tensor,
    valid: torch.Tensor,
    ctx_len: int,
    block_size: int,
    sliding_window: int | None,
) -> torch.Tensor:
    """Long[B, A*Bs, 4]: each query row's visible keys as two half-open intervals of key indices.

    The rule of block_attention_mask read as intervals: [ctx_lo, ctx_hi) of the context part and
    [blk_lo, blk_hi) of the block part (offset by ctx_len). Each row sees exactly the union of the two, so a
    tile's visibility follows from the rows' intervals without materialising the [N, T+N] mask.
    """
    batch, num = anchors.shape
    device = anchors.device
    slot = torch.arange(block_size, device=device)
    anchor = anchors[:, :, None].expand(batch, num, block_size)  # [B, A, Bs]
    pos = anchor + slot
    ctx_hi = torch.where(valid[:, :, None], anchor.clamp(max=ctx_len), 0)
    blk_start = ctx_len + torch.arange(num, device=device)[:, None] * block_size  # [A, 1]
    if sliding_window is None:
        ctx_lo = torch.zeros_like(ctx_hi)
        blk_lo = blk_start.expand(batch, num, block_size)
        blk_hi = blk_lo + block_size
    else:
        ctx_lo = (pos - sliding_window + 1).clamp(min=0)
        blk_lo = (blk_start + (slot - sliding_window + 1).clamp(min=0)).expand(batch, num, block_size)
        blk_hi = (blk_start + (slot + sliding_window).clamp(max=block_size)).expand(batch, num, block_size)
    ctx_lo = torch.minimum(ctx_lo, ctx_hi)  # an empty context interval stays empty
    return torch.stack([ctx_lo, ctx_hi, blk_lo, blk_hi], dim=-1).flatten(1, 2)


def tile_visibility(intervals: torch.Tensor, num_keys: int, tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bool[B, Q tiles, K tiles] twice: tiles with some visible pair but not all (partial), and tiles whose
    every pair is visible (full), from visible_key_intervals' rows.

    The same split as FlexAttention's create_block_mask makes from the dense mask: rows and keys past the
    ends count as hidden, so an edge tile is never full.
    """
    rows = intervals.shape[1]
    starts = torch.arange(0, num_keys, tile, device=intervals.device)
    ends = (starts + tile).clamp(max=num_keys)

    def overlap(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        return (torch.minimum(hi[..., None], ends) - torch.maximum(lo[..., None], starts)).clamp(min=0)

    counts = overlap(intervals[..., 0], intervals[..., 1]) + overlap(intervals[..., 2], intervals[..., 3])
    pad = -rows % tile
    counts = torch.nn.functional.pad(counts, (0, 0, 0, pad)).unflatten(1, (-1, tile))  # [B, Qt, tile, Kt]
    some = (counts > 0).any(dim=2)
    full = (counts == tile).all(dim=2)
    return some & ~full, full
