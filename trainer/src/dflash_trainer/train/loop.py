"""Single-process training: data -> target forward -> drafter step, with EMA, evaluation and checkpoints.

Resumes from the newest checkpoint in train.checkpoint_dir. Per-step hooks (STATUS, watchdog, trackers) are
plain callables given StepMetrics; a `stop` event (set by a SIGTERM handler) saves and returns cleanly.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dflash_trainer.checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from dflash_trainer.config import TrainConfig
from dflash_trainer.data.batch import Batch, batches, collate
from dflash_trainer.data.shards import ShardReader, list_shards, read_segments, split_held_out
from dflash_trainer.ema import CpuEma
from dflash_trainer.evaluate import evaluate, walk_prompts
from dflash_trainer.model.drafter import DFlashDrafter, DrafterSpec
from dflash_trainer.model.target import TargetModel, load_target
from dflash_trainer.train.trainer import (
    DrafterTrainer,
    StepMetrics,
    autocast,
    objective_config,
    prepare_drafter,
)
from dflash_trainer.walk import WalkSettings

log = logging.getLogger("dflash_trainer.train")

Hook = Callable[[StepMetrics], None]


@dataclass
class TrainResult:
    step: int
    checkpoint: Path | None
    last: StepMetrics | None
    stopped: bool  # ended by the stop event, not by reaching the step limit


def resolve_device(cfg: TrainConfig) -> torch.device:
    if cfg.train.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if cfg.train.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("train.device is cuda, but no CUDA device is visible")
    return torch.device(cfg.train.device)


def drafter_spec(cfg: TrainConfig, target: TargetModel) -> DrafterSpec:
    d = cfg.drafter
    spec = DrafterSpec.from_target_config(
        target.config,
        d.num_layers,
        d.block_size,
        d.mask_token_id,
        layer_types=d.layer_types,
        sliding_window=d.sliding_window,
        intermediate_size=d.intermediate_size,
        target_layer_ids=d.target_layer_ids,
        rope_theta=d.rope_theta,
    )
    heads = {
        k: getattr(d, k) for k in ("num_attention_heads", "num_key_value_heads", "head_dim") if getattr(d, k)
    }
    return dataclasses.replace(spec, **heads)


def horizon(cfg: TrainConfig, num_rows: int) -> int:
    """Optimizer steps of the whole run: train.max_steps if set, else optim.epochs over the training rows."""
    if cfg.train.max_steps is not None:
        return cfg.train.max_steps
    return math.ceil(cfg.optim.epochs * num_rows / cfg.optim.batch)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class Run:
    """Everything a training run holds; `train` drives it, tests and the learn demo poke at it."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.device = resolve_device(cfg)
        seed_everything(cfg.data.seed)
        dtype = (
            torch.bfloat16 if self.device.type == "cuda" and cfg.train.dtype == "bfloat16" else torch.float32
        )
        t = cfg.train
        walks = bool(t.eval_walk_prompts and cfg.data.held_out)
        self.target = load_target(
            cfg.model.target_path,
            device=self.device,
            dtype=dtype,
            layer_ids=cfg.drafter.target_layer_ids,
            full=walks,  # the decode walk needs the logits
        )
        self.spec = drafter_spec(cfg, self.target)
        drafter = DFlashDrafter(self.spec).to(self.device)  # fp32 master weights; autocast does bf16
        self.drafter = prepare_drafter(drafter, cfg)

        train_segments, held_segments = split_held_out(list_shards(cfg.data.shards), cfg.data.held_out)
        self.reader = ShardReader(train_segments, seed=cfg.data.seed, shuffle_window=cfg.data.shuffle_window)
        self.held_out: list[Batch] = list(
            batches(read_segments(held_segments), cfg.optim.batch, cfg.data.seq_len)
        )
        self.walk_prompts = (
            walk_prompts(self.held_out, t.eval_walk_prompts, t.eval_walk_prompt_len) if walks else []
        )
        self.walk = WalkSettings(max_new_tokens=t.eval_walk_new_tokens)
        self.total_steps = horizon(cfg, self.reader.num_rows)
        self.trainer = DrafterTrainer(
            self.drafter, self.target.embed_tokens, self.target.lm_head, cfg, total_steps=self.total_steps
        )
        self.ema = CpuEma(self.drafter, decay=cfg.train.ema_decay, every=cfg.train.ema_every)
        self._rows: Iterator = iter(self.reader)

    @property
    def step(self) -> int:
        return self.trainer.step_count

    def resume(self) -> Path | None:
        """Loads the newest checkpoint, if any; returns it."""
        path = latest_checkpoint(self.cfg.train.checkpoint_dir)
        if path is None:
            return None
        state, ema_state = load_checkpoint(path)
        self.trainer.load_state_dict(state["trainer"])
        self.reader.load_state_dict(state["data"])
        self._rows = iter(self.reader)
        set_rng_state(state["rng"], self.trainer.generator)
        self.ema.load_state_dict(ema_state)
        log.info("resumed from %s (step %d)", path, self.step)
        return path

    def save(self) -> Path:
        state = {
            "trainer": self.trainer.state_dict(),
            "data": self.reader.state_dict(),
            "rng": rng_state(self.trainer.generator),
            "spec": self.spec.config_dict(),
            "config": self.cfg.to_dict(),
        }
        path = save_checkpoint(
            self.cfg.train.checkpoint_dir,
            self.step,
            state,
            self.ema.state_dict(),
            keep_last=self.cfg.train.keep_last,
        )
        log.info("saved %s", path)
        return path

    def next_batch(self) -> Batch:
        rows = [next(self._rows) for _ in range(self.cfg.optim.batch)]
        return collate(rows, self.cfg.data.seq_len).to(self.device)

    def train_step(self) -> StepMetrics:
        """One step: the target forward here, then the drafter step (a pipeline splits exactly here)."""
        start = time.perf_counter()
        batch = self.next_batch()
        with autocast(self.cfg, self.device):
            captured = self.target.capture(batch.input_ids, batch.attention_mask, batch.loss_mask)
        metrics = self.trainer.step(captured)
        self.ema.update(self.drafter, metrics.step)
        metrics.tokens_per_s = metrics.seq_tokens / (time.perf_counter() - start)
        return metrics

    def evaluate(self) -> dict[str, float]:
        with autocast(self.cfg, self.device):
            result = evaluate(
                self.drafter,
                self.target,
                self.held_out,
                objective_config(self.cfg),
                prompts=self.walk_prompts,
                walk=self.walk,
            )
        return result.as_dict()


def _log_line(m: StepMetrics) -> str:
    line = (
        f"step {m.step} loss {m.loss:.4f} lr {m.lr:.2e} grad {m.grad_norm:.2f} "
        f"accept {m.acceptance_length:.2f} tok/s {m.tokens_per_s:.0f}"
    )
    if m.eval:
        line += f" | held-out loss {m.eval['loss']:.4f} anchor_accept {m.eval['anchor_accept']:.2f}"
        if "walk_tau" in m.eval:
            e = m.eval
            line += f" walk tau {e['walk_tau']:.2f} ({e['walk_tok_s']:.0f} tok/s, {e['walk_s']:.1f} s)"
    return line


def train(
    cfg: TrainConfig,
    *,
    max_steps: int | None = None,
    hooks: Sequence[Hook] = (),
    stop: threading.Event | None = None,
    on_ready: Callable[[], None] | None = None,
) -> TrainResult:
    """Trains until the schedule's horizon, or `max_steps` (a stop, not a new horizon), or `stop` is set.

    `on_ready` is called once models, data and the newest checkpoint are loaded (systemd's READY=1).
    """
    run = Run(cfg)
    checkpoint = run.resume()
    if on_ready is not None:
        on_ready()
    saved_at = run.step
    limit = run.total_steps if max_steps is None else min(max_steps, run.total_steps)
    t = cfg.train
    metrics = None
    log.info(
        "training %s drafter on %s: step %d of %d",
        f"{cfg.drafter.num_layers}-layer",
        run.device,
        run.step,
        limit,
    )
    while run.step < limit:
        if stop is not None and stop.is_set():
            break
        metrics = run.train_step()
        if t.eval_every and metrics.step % t.eval_every == 0:
            metrics.eval = run.evaluate()
        if metrics.step % t.log_every == 0 or metrics.eval:
            log.info("%s", _log_line(metrics))
        for hook in hooks:
            hook(metrics)
        if metrics.step % t.checkpoint_every == 0:
            checkpoint, saved_at = run.save(), run.step
    stopped = run.step < limit
    if run.step != saved_at:  # the final position, unless just saved
        checkpoint = run.save()
    return TrainResult(step=run.step, checkpoint=checkpoint, last=metrics, stopped=stopped)
