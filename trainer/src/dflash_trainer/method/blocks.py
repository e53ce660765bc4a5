"""Block inputs, positions and labels for a set of anchors."""

from __future__ import annotations

import torch

IGNORE_INDEX = -100


def _offsets(block_size: int, device: torch.device) -> torch.Tensor:
    return torch.arange(block_size, device=device)


def block_positions(anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """Long[B, A*Bs]: absolute position of every block slot (anchor + k), used for RoPE."""
    pos = anchors[:, :, None] + _offsets(block_size, anchors.device)[None, None, :]
    return pos.flatten(1)


def block_input_ids(
    input_ids: torch.Tensor, anchors: torch.Tensor, valid: torch.Tensor, block_size: int, mask_token_id: int
) -> torch.Tensor:
    """Long[B, A*Bs]: each block is [anchor token, MASK x (Bs-1)]; invalid blocks are all MASK."""
    batch, num = anchors.shape
    ids = torch.full((batch, num, block_size), mask_token_id, dtype=input_ids.dtype, device=input_ids.device)
    ids[:, :, 0] = torch.where(valid, input_ids.gather(1, anchors), mask_token_id)
    return ids.flatten(1)


def block_labels(
    input_ids: torch.Tensor,
    anchors: torch.Tensor,
    valid: torch.Tensor,
    block_size: int,
    loss_mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(labels Long[B,A*Bs], weight Float[B,A*Bs]).

    Slot k of a block predicts token anchor+k (no shift: serving reads the drafter's output at the MASK
    slot itself). Slot 0 is the known anchor and never counts; slots past the sequence, outside the
    supervised part or in invalid blocks get weight 0 and label IGNORE_INDEX.
    """
    seq_len = input_ids.shape[1]
    pos = anchors[:, :, None] + _offsets(block_size, anchors.device)[None, None, :]
    inside = pos < seq_len
    safe = pos.clamp(max=seq_len - 1).flatten(1)
    supervised = loss_mask.bool().gather(1, safe).view_as(pos)
    keep = inside & supervised & valid[:, :, None]
    keep[:, :, 0] = False
    labels = torch.where(keep.flatten(1), input_ids.gather(1, safe), IGNORE_INDEX)
    return labels, keep.flatten(1).float()
