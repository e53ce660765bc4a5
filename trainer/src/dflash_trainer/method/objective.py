"""The DFlash training objective: anchors -> blocks -> drafter -> weighted chunked CE, plus accuracy stats."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from dflash_trainer.method.acceptance import anchor_accept
from dflash_trainer.method.anchors import sample_anchors
from dflash_trainer.method.blocks import block_input_ids, block_labels
from dflash_trainer.method.loss import chunked_block_loss, gamma_for_block_size, position_weights

if TYPE_CHECKING:
    from dflash_trainer.data.batch import TargetBatch


class BlockDrafter(Protocol):
    """What the objective needs of a drafter (model.drafter.DFlashDrafter is one)."""

    def forward_blocks(
        self, context: torch.Tensor, noise_embedding: torch.Tensor, anchors: torch.Tensor, valid: torch.Tensor
    ) -> torch.Tensor:
        """Hidden states [B, A*Bs, H] of every block, laid out as method.blocks lays out the ids."""
        ...


@dataclass(frozen=True)
class ObjectiveConfig:
    block_size: int
    mask_token_id: int
    max_anchors: int = 512
    gamma: float | None = None  # None: the paper's value for block_size
    loss_chunk_size: int = 2048
    # method.loss.LOSS_IMPLS: fused, fused-torch or checkpointed (the benchmarks compare them)
    loss_impl: str = "fused"

    def resolved_gamma(self) -> float:
        return self.gamma if self.gamma is not None else gamma_for_block_size(self.block_size)


@dataclass
class ObjectiveOutput:
    loss: torch.Tensor  # scalar, differentiable w.r.t. the drafter
    num_tokens: int  # supervised block positions in this batch
    per_position_acc: torch.Tensor  # Float[Bs-1]: greedy top-1 accuracy of slots 1..Bs-1
    anchor_accept: float  # per-anchor (accepted run + 1), not serving's tau: see method.acceptance


def dflash_loss(
    drafter: BlockDrafter,
    target_batch: TargetBatch,
    embed_tokens: nn.Embedding,
    lm_head: nn.Linear,
    cfg: ObjectiveConfig,
    generator: torch.Generator,
) -> ObjectiveOutput:
    """One DFlash loss over a captured target batch; anchors are drawn fresh from `generator`.

    The acceptance statistic compares the drafter's greedy tokens with the labels, i.e. it assumes the
    training responses are the target's own greedy outputs (regenerated data); otherwise it is a proxy.
    """
    bs = cfg.block_size
    input_ids, loss_mask = target_batch.input_ids, target_batch.loss_mask
    anchors, valid = sample_anchors(loss_mask, cfg.max_anchors, bs, generator)
    ids = block_input_ids(input_ids, anchors, valid, bs, cfg.mask_token_id)
    labels, keep = block_labels(input_ids, anchors, valid, bs, loss_mask)
    decay = position_weights(bs, cfg.resolved_gamma()).to(keep.device)
    weight = keep * decay.repeat(anchors.shape[1])[None, :]

    hidden = drafter.forward_blocks(target_batch.context, embed_tokens(ids), anchors, valid)
    loss, stats = chunked_block_loss(
        hidden, lm_head.weight, labels, weight, cfg.loss_chunk_size, impl=cfg.loss_impl
    )

    batch, num = anchors.shape
    preds = stats.predictions.view(batch, num, bs)
    slot_labels = labels.view(batch, num, bs)
    counted = keep.view(batch, num, bs)[..., 1:]
    hits = ((preds[..., 1:] == slot_labels[..., 1:]).float() * counted).sum(dim=(0, 1))
    per_position_acc = hits / counted.sum(dim=(0, 1)).clamp(min=1.0)
    return ObjectiveOutput(
        loss=loss,
        num_tokens=stats.num_tokens,
        per_position_acc=per_position_acc.detach(),
        anchor_accept=anchor_accept(preds, slot_labels, valid),
    )
