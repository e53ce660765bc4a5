"""What the configuration means on this machine: the device, the weights' dtype, the autocast and the
training objective's settings (a leaf the training sides and the evaluation both use)."""

from __future__ import annotations

import contextlib

import torch

from dflash_trainer.config import TrainConfig
from dflash_trainer.method.objective import ObjectiveConfig


def resolve_device(cfg: TrainConfig) -> torch.device:
    if cfg.train.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if cfg.train.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("train.device is cuda, but no CUDA device is visible")
    return torch.device(cfg.train.device)


def run_dtype(cfg: TrainConfig, device: torch.device) -> torch.dtype:
    """The target's weights and the wire's features: bf16 on CUDA when train.dtype says so, else fp32."""
    return torch.bfloat16 if device.type == "cuda" and cfg.train.dtype == "bfloat16" else torch.float32


def autocast(cfg: TrainConfig, device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast on CUDA when train.dtype says so; fp32 elsewhere (CPU runs are tests and the lab)."""
    if device.type == "cuda" and cfg.train.dtype == "bfloat16":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def objective_config(cfg: TrainConfig) -> ObjectiveConfig:
    d = cfg.drafter
    return ObjectiveConfig(
        block_size=d.block_size,
        mask_token_id=d.mask_token_id,
        max_anchors=cfg.data.max_anchors,
        gamma=d.gamma,
        loss_chunk_size=cfg.train.loss_chunk,
    )
