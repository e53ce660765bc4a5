"""Held-out evaluation: loss, per-position accuracy, the per-anchor acceptance and the decode walk's tau.

Two acceptance figures, kept apart by name:

- `walk_tau` (evaluation/walk.py): real greedy speculative decoding of held-out prompts, the figure serving
  reports (dflash's "Average Acceptance length"). The one to judge a drafter by.
- `anchor_accept`: the mean of (accepted run + 1) over training-style blocks at anchors sampled uniformly by
  position. Decoding advances by the accepted length, so long accepted stretches take few steps; the
  per-anchor mean overweights them and reads well above serving's tau (3.37 against 2.33 for the same
  drafter; docs/acceptance.md). Useful only as a cheap trend and a check of the per-block rule.

Anchors come from a fixed seed, so successive evaluations score the same blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dflash_trainer.data.batch import Batch
from dflash_trainer.evaluation.walk import WalkResult, WalkSettings, decode_walk, prompts_from_rows
from dflash_trainer.method.objective import ObjectiveConfig, dflash_loss
from dflash_trainer.model.drafter import DFlashDrafter
from dflash_trainer.model.target import TargetModel

EVAL_SEED = 1234


@dataclass
class EvalResult:
    loss: float
    anchor_accept: float  # per-anchor (accepted run + 1): NOT serving's tau, see the module docstring
    per_position_acc: list[float]  # slots 1..Bs-1
    num_tokens: int
    walk: WalkResult | None = None

    def as_dict(self) -> dict[str, float]:
        figures = {"loss": self.loss, "anchor_accept": self.anchor_accept}
        figures |= {f"acc_{k + 1}": a for k, a in enumerate(self.per_position_acc)}
        if self.walk is not None:
            figures |= self.walk.as_dict()
        return figures


def first_rows(batches: Sequence[Batch], rows: int) -> list[Batch]:
    """The held-out batches that hold the first `rows` rows (the last one cut); every batch when rows is 0."""
    if rows == 0:
        return list(batches)
    kept: list[Batch] = []
    left = rows
    for b in batches:
        if left <= 0:
            break
        if b.input_ids.shape[0] > left:
            b = Batch(b.input_ids[:left], b.attention_mask[:left], b.loss_mask[:left])
        kept.append(b)
        left -= b.input_ids.shape[0]
    return kept


def walk_prompts(batches: Sequence[Batch], num: int, max_len: int) -> list[torch.Tensor]:
    """The decode walk's fixed prompts: the prompts of the first `num` held-out rows that have one."""
    prompts: list[torch.Tensor] = []
    for b in batches:
        if len(prompts) >= num:
            break
        prompts += prompts_from_rows(b.input_ids, b.loss_mask, b.attention_mask, num - len(prompts), max_len)
    return prompts


@torch.no_grad()
def evaluate(
    drafter: DFlashDrafter,
    target: TargetModel,
    batches: Sequence[Batch],
    objective: ObjectiveConfig,
    *,
    prompts: Sequence[torch.Tensor] = (),
    walk: WalkSettings | None = None,
) -> EvalResult:
    """Token-weighted means over the held-out batches, then the decode walk over `prompts` if any (it needs
    the target loaded whole). The drafter is left in the mode it came in.

    Runs in the caller's precision context (the loop wraps it in the training autocast).
    """
    generator = torch.Generator().manual_seed(EVAL_SEED)
    device = target.device
    was_training = drafter.training
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
            accept += out.anchor_accept * n
            acc += out.per_position_acc.float().cpu() * n
            tokens += n
    finally:
        drafter.train(was_training)
    if tokens == 0:
        raise ValueError("the held-out rows have no supervised block positions")
    walked = decode_walk(target.model, drafter, prompts, walk or WalkSettings()) if prompts else None
    return EvalResult(loss / tokens, accept / tokens, (acc / tokens).tolist(), tokens, walked)
