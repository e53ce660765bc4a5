"""Position-weighted cross-entropy over the target's LM head, computed in chunks."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

# Decay of the loss weight along the block, from the paper: gamma 7 for B=16, 5 for 10, 4 for 8.
_GAMMA_BY_BLOCK_SIZE = {16: 7.0, 10: 5.0, 8: 4.0}


def gamma_for_block_size(block_size: int) -> float:
    try:
        return _GAMMA_BY_BLOCK_SIZE[block_size]
    except KeyError:
        known = sorted(_GAMMA_BY_BLOCK_SIZE)
        raise ValueError(f"no reference gamma for block_size {block_size} (known: {known}); set it") from None


def position_weights(block_size: int, gamma: float) -> torch.Tensor:
    """Float[Bs]: 0 for the anchor slot, exp(-(k-1)/gamma) for slot k >= 1."""
    k = torch.arange(block_size, dtype=torch.float32)
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w


@dataclass(frozen=True)
class LossStats:
    predictions: torch.Tensor  # Long[B,N]: drafter greedy token where weight > 0, else -1
    weight_sum: torch.Tensor  # scalar: normaliser of the loss
    num_tokens: int  # positions with weight > 0


def _chunk_loss(hidden: torch.Tensor, head: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor):
    logits = (hidden @ head.t()).float()
    ce = F.cross_entropy(logits, labels, reduction="none")
    return (ce * weight).sum(), logits.argmax(dim=-1)


def chunked_block_loss(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    weight: torch.Tensor,
    chunk_size: int,
) -> tuple[torch.Tensor, LossStats]:
    """sum(weight * CE(hidden @ W^T, labels)) / sum(weight), never holding more than one chunk of logits.

    Only positions with weight > 0 are computed. Each chunk runs under activation checkpointing, so its
    [chunk, V] logits are recomputed in backward instead of kept: value and gradients equal the unchunked
    loss, peak memory is one chunk.
    """
    flat_w = weight.reshape(-1)
    idx = flat_w.nonzero().squeeze(1)
    h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, idx)
    y = labels.reshape(-1).index_select(0, idx)
    w = flat_w.index_select(0, idx).float()
    total = hidden.new_zeros((), dtype=torch.float32) + hidden.sum() * 0.0  # keeps the graph when empty
    preds = []
    for start in range(0, idx.numel(), chunk_size):
        sl = slice(start, start + chunk_size)
        part, pred = checkpoint(_chunk_loss, h[sl], lm_head_weight, y[sl], w[sl], use_reentrant=False)
        total = total + part
        preds.append(pred)
    weight_sum = w.sum()
    loss = total / weight_sum.clamp(min=math.ulp(1.0))
    predictions = torch.full_like(labels.reshape(-1), -1)
    if preds:
        predictions[idx] = torch.cat(preds)
    stats = LossStats(predictions.view_as(labels), weight_sum.detach(), int(idx.numel()))
    return loss, stats
