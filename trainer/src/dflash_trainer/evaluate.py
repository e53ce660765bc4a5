"""Held-out evaluation: loss, per-position accuracy and simulated acceptance length.

Loss can fall while serving gets no faster (a shifted label, a leaking mask), so the figure to watch is the
acceptance length (method.acceptance: the greedy run a target would accept, +1). Anchors come from a fixed
seed, so successive evaluations score the same blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dflash_trainer.data.batch import Batch
from dflash_trainer.method.objective import ObjectiveConfig, dflash_loss
from dflash_trainer.model.drafter import DFlashDrafter
from dflash_trainer.model.target import TargetModel

EVAL_SEED = 1234


@dataclass
class EvalResult:
    loss: float
    acceptance_length: float
    per_position_acc: list[float]  # slots 1..Bs-1
    num_tokens: int

    def as_dict(self) -> dict[str, float]:
        figures = {"loss": self.loss, "acceptance_length": self.acceptance_length}
        figures |= {f"acc_{k + 1}": a for k, a in enumerate(self.per_position_acc)}
        return figures


@torch.no_grad()
def evaluate(
    drafter: DFlashDrafter,
    target: TargetModel,
    batches: Sequence[Batch],
    objective: ObjectiveConfig,
) -> EvalResult:
    """Token-weighted means over the held-out batches (the drafter is left in training mode).

    Runs in the caller's precision context (the loop wraps it in the training autocast).
    """
    generator = torch.Generator().manual_seed(EVAL_SEED)
    device = target.device
    drafter.eval()
    loss = accept = 0.0
    acc = torch.zeros(objective.block_size - 1)
    tokens = 0
    try:
        for batch in batches:
            b = batch.to(device)
            captured = target.capture(b.input_ids, b.attention_mask, b.loss_mask)
            out = dflash_loss(drafter, captured, target.embed_tokens, target.lm_head, objective, generator)
            n = out.num_tokens
            loss += float(out.loss) * n
            accept += out.acceptance_length * n
            acc += out.per_position_acc.float().cpu() * n
            tokens += n
    finally:
        drafter.train()
    if tokens == 0:
        raise ValueError("the held-out rows have no supervised block positions")
    return EvalResult(loss / tokens, accept / tokens, (acc / tokens).tolist(), tokens)
