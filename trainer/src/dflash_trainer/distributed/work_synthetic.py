"""A model-free workload with the pipeline's exact code path, for CI: checkable data, a tiny DDP model.

Items carry ids and features that are functions of the item number, so a drafter verifies that what arrived
is exactly the item the schedule promised. `target_s` / `drafter_s` sleep to stand for compute, which gives
controlled speeds without loading the two shared CPU cores of a CI machine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dflash_trainer.distributed.transport import TargetBatch, TransportError, WireFormat


@dataclass(frozen=True)
class SyntheticSpec:
    rows: int = 2
    seq_len: int = 32
    features: int = 16
    vocab: int = 97
    target_s: float = 0.0
    drafter_s: float = 0.0

    @property
    def wire(self) -> WireFormat:
        return WireFormat(self.rows, self.seq_len, self.features, torch.float32)

    def input_ids(self, item: int) -> torch.Tensor:
        length = self.seq_len - item % 3  # varying lengths exercise the padding
        base = torch.arange(length) + 31 * item
        return torch.stack([(base + r) % self.vocab for r in range(self.rows)])

    def context(self, ids: torch.Tensor) -> torch.Tensor:
        return ids.float()[..., None] + torch.arange(self.features) / self.features


class SyntheticProducer:
    def __init__(self, spec: SyntheticSpec, device: torch.device) -> None:
        self.spec, self.device = spec, device

    def load(self, item: int) -> torch.Tensor:
        return self.spec.input_ids(item).to(self.device)

    def forward(self, ids: torch.Tensor) -> TargetBatch:
        time.sleep(self.spec.target_s)
        return TargetBatch(input_ids=ids, loss_mask=ids % 2 == 0, context=self.spec.context(ids))


class SyntheticConsumer:
    def __init__(self, spec: SyntheticSpec, device: torch.device, group: dist.ProcessGroup | None) -> None:
        self.spec, self.device = spec, device
        torch.manual_seed(0)
        model = nn.Linear(spec.features, 1).to(device)
        self.model = model
        self.ddp: nn.Module = model
        if group is not None and dist.get_world_size(group) > 1:
            self.ddp = nn.parallel.DistributedDataParallel(model, process_group=group)
        self.optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
        self.checked = 0

    def step(self, step: int, item: int, batch: TargetBatch) -> str:
        ids = self.spec.input_ids(item).to(self.device)
        if not torch.equal(batch.input_ids, ids) or not torch.equal(batch.context, self.spec.context(ids)):
            raise TransportError(f"step {step}: item {item} arrived corrupted or out of order")
        if not torch.equal(batch.loss_mask, ids % 2 == 0):
            raise TransportError(f"step {step}: item {item} has a wrong loss mask")
        self.checked += 1
        out = self.ddp(batch.context).squeeze(-1)
        loss = (out * batch.loss_mask).pow(2).mean() * 1e-3
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        time.sleep(self.spec.drafter_s)
        return f"loss {loss.item():.4g}"

    def finish(self, step: int) -> dict[str, Any]:
        params = torch.cat([p.detach().flatten().double().cpu() for p in self.model.parameters()])
        return {"checked": self.checked, "param_sum": float(params.sum()), "steps": step}
