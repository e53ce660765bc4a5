"""Per-anchor acceptance: what greedy speculative decoding would accept per training block.

Per block this is dflash's rule; averaged over anchors sampled uniformly by position it is NOT the acceptance
length serving reports (that is the decode walk's tau, evaluation/walk.py): decoding advances by the
accepted length, so long accepted stretches take few steps, and a per-position average overweights them.
"""

from __future__ import annotations

import torch


def accepted_run(draft_tokens: torch.Tensor, target_tokens: torch.Tensor) -> torch.Tensor:
    """Long[B,A]: leading run of slots 1..Bs-1 where the drafter's token equals the target's."""
    match = (draft_tokens[..., 1:] == target_tokens[..., 1:]).long()
    return match.cumprod(dim=-1).sum(dim=-1)


def anchor_accept(draft_tokens: torch.Tensor, target_tokens: torch.Tensor, valid: torch.Tensor) -> float:
    """Mean over valid blocks of (accepted run + 1): the +1 is the token the target verifies for free.

    Same rule as dflash_generate's greedy path: `(draft[1:] == posterior[:-1]).cumprod().sum()`.
    """
    if not bool(valid.any()):
        return 0.0
    run = accepted_run(draft_tokens, target_tokens)
    return float((run[valid].float() + 1.0).mean())
