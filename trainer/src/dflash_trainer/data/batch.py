"""Rows to padded tensors, and the TargetBatch a target hands to the drafter step (no transformers import)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from dflash_trainer.data.shards import Sample


@dataclass
class Batch:
    input_ids: torch.Tensor  # Long[B, T], right-padded with 0
    attention_mask: torch.Tensor  # Long[B, T], 1 on real tokens
    loss_mask: torch.Tensor  # Bool[B, T], False on padding

    def to(self, device: torch.device | str) -> Batch:
        return Batch(
            *(t.to(device, non_blocking=True) for t in (self.input_ids, self.attention_mask, self.loss_mask))
        )


@dataclass
class TargetBatch:
    """What the frozen target produces and the drafter step consumes, in one process or over the wire."""

    input_ids: torch.Tensor  # Long[B,T]
    loss_mask: torch.Tensor  # Bool[B,T]: supervised tokens
    context: torch.Tensor  # [B,T,K*H]: outputs of the target layers, in target_layer_ids order


def collate(samples: Sequence[Sample], seq_len: int) -> Batch:
    """Truncates each row to seq_len and pads to the longest row of the batch."""
    length = max(min(len(s.input_ids), seq_len) for s in samples)
    input_ids = torch.zeros(len(samples), length, dtype=torch.long)
    attention_mask = torch.zeros(len(samples), length, dtype=torch.long)
    loss_mask = torch.zeros(len(samples), length, dtype=torch.bool)
    for i, s in enumerate(samples):
        n = min(len(s.input_ids), seq_len)
        input_ids[i, :n] = torch.from_numpy(s.input_ids[:n])
        attention_mask[i, :n] = 1
        loss_mask[i, :n] = torch.from_numpy(s.loss_mask[:n])
    return Batch(input_ids, attention_mask, loss_mask)


def batches(samples: Iterator[Sample] | Sequence[Sample], batch_size: int, seq_len: int) -> Iterator[Batch]:
    """Consecutive groups of batch_size rows; a short last group of a finite sequence is kept."""
    group: list[Sample] = []
    for sample in samples:
        group.append(sample)
        if len(group) == batch_size:
            yield collate(group, seq_len)
            group = []
    if group:
        yield collate(group, seq_len)
