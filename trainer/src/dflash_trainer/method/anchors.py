"""Anchor sampling: where the training blocks start."""

from __future__ import annotations

import torch


def eligible_anchors(loss_mask: torch.Tensor, block_size: int) -> torch.Tensor:
    """Bool[B,T]: positions that may start a block.

    An anchor a needs context before it (a >= 1), a supervised first prediction (loss_mask[a+1]) and
    room for the whole block inside the sequence (a + block_size <= T).
    """
    _, seq_len = loss_mask.shape
    ok = torch.zeros_like(loss_mask, dtype=torch.bool)
    last = seq_len - block_size  # inclusive upper bound for an anchor
    if last >= 1:
        ok[:, 1 : last + 1] = loss_mask[:, 2 : last + 2].bool()
    return ok


def sample_anchors(
    loss_mask: torch.Tensor, max_anchors: int, block_size: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to `max_anchors` distinct anchors per sequence, uniformly among eligible positions, sorted.

    Returns (anchors Long[B,A], valid Bool[B,A]) with A >= 1 so shapes never collapse; invalid slots hold
    anchor 0 and must be ignored (their labels carry no weight).
    """
    ok = eligible_anchors(loss_mask, block_size)
    counts = ok.sum(dim=1)
    num = max(1, min(max_anchors, int(counts.max().item()) if ok.numel() else 0))
    keys = torch.rand(ok.shape, generator=generator, device=generator.device).to(ok.device)
    keys = keys.masked_fill(~ok, -1.0)  # ineligible positions sort last
    top = keys.topk(num, dim=1).indices
    valid = torch.arange(num, device=ok.device)[None, :] < counts[:, None].clamp(max=max_anchors)
    anchors = torch.where(valid, top, torch.zeros_like(top))
    # Sort valid anchors ascending, invalid slots last.
    order = torch.where(valid, anchors, torch.full_like(anchors, ok.shape[1])).argsort(dim=1)
    return anchors.gather(1, order), valid.gather(1, order)
