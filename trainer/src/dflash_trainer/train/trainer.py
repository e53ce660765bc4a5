"""The drafter's optimisation step, separate from the target forward that feeds it.

`DrafterTrainer.step(target_batch)` is all a drafter rank does per step; whoever produced the TargetBatch (the
target in this process, or a target rank over torch.distributed) is not its concern.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn

from dflash_trainer.config import TrainConfig
from dflash_trainer.method.objective import ObjectiveConfig, dflash_loss
from dflash_trainer.model.drafter import DFlashDrafter
from dflash_trainer.model.target import TargetBatch


@dataclass
class StepMetrics:
    step: int  # optimizer steps done, this one included
    loss: float
    lr: float
    grad_norm: float
    num_tokens: int  # supervised block positions
    seq_tokens: int  # target tokens of the batch (B*T)
    acceptance_length: float
    per_position_acc: list[float]
    step_s: float  # the drafter step alone
    tokens_per_s: float = 0.0  # seq_tokens over the whole step (data + target + drafter); set by the loop
    eval: dict[str, float] = field(default_factory=dict)  # held-out figures on steps that evaluated


def lr_factor(step: int, *, total: int, warmup: int, schedule: str, min_ratio: float) -> float:
    """Linear warmup over `warmup` steps, then cosine from 1 down to min_ratio at `total` (or constant)."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def objective_config(cfg: TrainConfig) -> ObjectiveConfig:
    d = cfg.drafter
    return ObjectiveConfig(
        block_size=d.block_size,
        mask_token_id=d.mask_token_id,
        max_anchors=cfg.data.max_anchors,
        gamma=d.gamma,
        loss_chunk_size=cfg.train.loss_chunk,
    )


def autocast(cfg: TrainConfig, device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast on CUDA when train.dtype says so; fp32 elsewhere (CPU runs are tests and demos)."""
    if device.type == "cuda" and cfg.train.dtype == "bfloat16":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def prepare_drafter(drafter: DFlashDrafter, cfg: TrainConfig) -> DFlashDrafter:
    """Applies train.gradient_checkpointing and train.compile.

    Each decoder layer is compiled in place (module.compile), so parameter names, and with them checkpoints
    and the export, stay those of the plain module; checkpointing wraps the compiled layer, which replays it.
    """
    drafter.gradient_checkpointing = cfg.train.gradient_checkpointing
    if cfg.train.compile:
        for layer in drafter.layers:
            layer.compile(backend=cfg.train.compile_backend)
    return drafter


class DrafterTrainer:
    """AdamW with warmup + cosine and gradient clipping over one drafter; owns the anchor generator."""

    def __init__(
        self,
        drafter: DFlashDrafter,
        embed_tokens: nn.Embedding,
        lm_head: nn.Linear,
        cfg: TrainConfig,
        *,
        total_steps: int,
    ) -> None:
        self.drafter = drafter
        self.embed_tokens = embed_tokens
        self.lm_head = lm_head
        self.cfg = cfg
        self.objective = objective_config(cfg)
        self.device = next(drafter.parameters()).device
        self.total_steps = total_steps
        o = cfg.optim
        decay = [p for p in drafter.parameters() if p.ndim >= 2]  # no weight decay on norm scales
        no_decay = [p for p in drafter.parameters() if p.ndim < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=o.lr,
            betas=(o.betas[0], o.betas[1]),
            fused=self.device.type == "cuda",
        )
        factor = partial(
            lr_factor,
            total=total_steps,
            warmup=round(o.warmup_ratio * total_steps),
            schedule=o.schedule,
            min_ratio=o.min_lr_ratio,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, factor)
        # Anchors are drawn on the CPU so the same seed gives the same anchors on any device.
        self.generator = torch.Generator().manual_seed(cfg.data.seed)
        self.step_count = 0

    def step(self, batch: TargetBatch) -> StepMetrics:
        start = time.perf_counter()
        self.drafter.train()
        with autocast(self.cfg, self.device):
            out = dflash_loss(
                self.drafter, batch, self.embed_tokens, self.lm_head, self.objective, self.generator
            )
        self.optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), self.cfg.optim.grad_clip)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.step_count += 1
        loss = float(out.loss.detach())  # the one host sync of the step
        return StepMetrics(
            step=self.step_count,
            loss=loss,
            lr=lr,
            grad_norm=float(grad_norm),
            num_tokens=out.num_tokens,
            seq_tokens=batch.input_ids.numel(),
            acceptance_length=out.acceptance_length,
            per_position_acc=out.per_position_acc.tolist(),
            step_s=time.perf_counter() - start,
        )

    def state_dict(self) -> dict:
        return {
            "drafter": self.drafter.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "step": self.step_count,
        }

    def load_state_dict(self, state: dict) -> None:
        self.drafter.load_state_dict(state["drafter"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step_count = state["step"]
