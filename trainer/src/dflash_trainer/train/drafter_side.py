"""`DrafterSide` (a drafter rank, or the drafter half of a single process): the drafter, AdamW with warmup +
cosine, gradient clipping, DDP over the drafter ranks, the CPU EMA, the checkpoint (saved in the background,
atomic) and the resume."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dflash_trainer import startup
from dflash_trainer.checkpoint import (
    AsyncCheckpointer,
    latest_checkpoint,
    load_checkpoint,
    rng_state,
    set_rng_state,
)
from dflash_trainer.config import TrainConfig
from dflash_trainer.data.batch import TargetBatch
from dflash_trainer.method.objective import ObjectiveOutput, dflash_loss
from dflash_trainer.runtime import autocast, objective_config
from dflash_trainer.train.schedule import Horizon, Position, anchor_seed
from dflash_trainer.train.setup import build_drafter
from dflash_trainer.train.target_side import EvalExchange

log = logging.getLogger("dflash_trainer.train")


@dataclass
class StepMetrics:
    step: int  # optimizer steps done, this one included
    loss: float
    lr: float
    grad_norm: float
    num_tokens: int  # supervised block positions
    seq_tokens: int  # target tokens of the batch (B*T)
    anchor_accept: float  # per-anchor (accepted run + 1) of this batch: a trend, not serving's tau
    per_position_acc: list[float]
    step_s: float  # the drafter step alone
    tokens_per_s: float = 0.0  # tokens of the whole pipeline per second of wall time; set by the loop
    eval: dict[str, float] = field(default_factory=dict)  # held-out figures that arrived with this step


class _DdpForward(nn.Module):
    """What DDP wraps: the drafter's own forward, called as a class function (see DrafterSide)."""

    def __init__(self, drafter: nn.Module) -> None:
        super().__init__()
        self.drafter = drafter

    def forward(self, *args: Any) -> torch.Tensor:
        return type(self.drafter).forward(self.drafter, *args)


class DrafterSide:
    """A drafter rank's work (roles.Consumer): the optimizer step, the EMA, the checkpoint and the resume.

    Gradients are averaged over the drafter ranks by DDP. The objective calls `drafter.forward_blocks`, which
    calls `self.forward`; DDP must see that call, so the drafter's instance `forward` is pointed at the DDP
    wrapper, whose module runs the class's forward. Parameter names, checkpoints and the export stay those of
    the plain drafter. The leader (drafter 0) keeps the EMA and writes the checkpoints.
    """

    def __init__(
        self,
        cfg: TrainConfig,
        head: Any,  # a TargetModel: its embedding, head and config (the stack may be absent)
        hz: Horizon,
        *,
        device: torch.device,
        index: int = 0,
        num_drafters: int = 1,
        group: Any = None,  # the drafter ranks' process group (None: a lone drafter)
        save: bool = True,
        data_state: Callable[[int], dict[str, int] | None] = lambda _item: None,
        drafter: nn.Module | None = None,  # a prepared drafter (benchmarks); default: build_drafter
    ) -> None:
        from dflash_trainer.ema import CpuEma

        self.cfg, self.device, self.horizon, self.data_state = cfg, device, hz, data_state
        self.leader = index == 0
        self.num_drafters = num_drafters
        self.embed_tokens, self.lm_head = head.embed_tokens, head.lm_head
        start = time.perf_counter()
        with startup.phase("drafter"):
            self.drafter = drafter if drafter is not None else build_drafter(cfg, head.config, device)
        self.spec = self.drafter.spec
        if group is not None and torch.distributed.get_world_size(group) > 1:
            ddp = nn.parallel.DistributedDataParallel(
                _DdpForward(self.drafter),
                process_group=group,
                device_ids=[self.device] if self.device.type == "cuda" else None,
            )
            # A plain instance attribute (nn.Module.__setattr__ would register DDP as a child, a cycle).
            self.drafter.__dict__["forward"] = ddp
        o = cfg.optim
        params = list(self.drafter.parameters())
        with startup.phase("optimizer"):
            self.optimizer = torch.optim.AdamW(
                [
                    {"params": [p for p in params if p.ndim >= 2], "weight_decay": o.weight_decay},
                    {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},  # norm scales
                ],
                lr=o.lr,
                betas=(o.betas[0], o.betas[1]),
                fused=self.device.type == "cuda",
            )
        self.objective = objective_config(cfg)
        self.generator = torch.Generator()  # anchors, drawn on the CPU: the same on any device
        self.step_count = 0
        self.offset = 0  # optimizer step minus pipeline step (see Position.span)
        with startup.phase("EMA"):
            self.ema = (
                CpuEma(self.drafter, decay=cfg.train.ema_decay, every=cfg.train.ema_every)
                if self.leader
                else None
            )
        if self.leader:  # where a start's seconds go (the warm restart's goal is its first step in < 30 s)
            log.info(
                "drafter: %d layers, %.2fB parameters on %s, with its optimizer and EMA, in %.1f s",
                cfg.drafter.num_layers, sum(p.numel() for p in params) / 1e9, device,
                time.perf_counter() - start,
            )  # fmt: skip
        t = cfg.train
        self.checkpointer = (
            AsyncCheckpointer(t.checkpoint_dir, keep_last=t.keep_last) if save and self.leader else None
        )
        self.last: StepMetrics | None = None
        self.exchange: EvalExchange | None = None  # the leader's evaluation hand-off in a pipeline
        self.stopped = False
        self.save_due = False  # a periodic save deferred while the previous write runs
        self.saved_step: int | None = None  # the optimizer step of the newest save started

    # -- the step

    def _loss(self, batch: TargetBatch, generator: torch.Generator) -> ObjectiveOutput:
        self.drafter.train()
        with autocast(self.cfg, self.device):
            return dflash_loss(
                self.drafter, batch, self.embed_tokens, self.lm_head, self.objective, generator
            )

    def step(self, step: int, item: int, batch: TargetBatch) -> str:
        """Pipeline step `step` on `item`: one optimizer step. Returns a short log fragment."""
        if self.checkpointer is not None:
            self.checkpointer.check()  # a background write that failed ends the run here
        start = time.perf_counter()
        items_before = step * self.num_drafters
        lr = self.cfg.optim.lr * self.horizon.lr_factor(self.step_count, items_before, self.cfg.optim)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.generator.manual_seed(anchor_seed(self.cfg.data.seed, item))
        if self.ema is not None:
            self.ema.begin()  # the average starts at the weights before the first step (a resume: loaded)
        out = self._loss(batch, self.generator)
        self.optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), self.cfg.optim.grad_clip)
        if self.ema is not None:
            self.ema.before_weights_change()  # a fresh start's average copies the weights meanwhile
        self.optimizer.step()
        self.step_count += 1
        if self.ema is not None:
            self.ema.prepare()  # its pinning, off a resume's start: behind the first step's queued kernels
        loss = float(out.loss.detach())  # the one host sync of the step
        if self.ema is not None:
            self.ema.update(self.drafter, self.step_count)
        m = StepMetrics(
            step=self.step_count,
            loss=loss,
            lr=lr,
            grad_norm=float(grad_norm),
            num_tokens=out.num_tokens,
            seq_tokens=batch.input_ids.numel(),
            anchor_accept=out.anchor_accept,
            per_position_acc=out.per_position_acc.tolist(),
            step_s=time.perf_counter() - start,
        )
        self.last = m
        if self.exchange is not None:
            if self.exchange.due(step):
                self.exchange.send(step, self.drafter)
            m.eval = self.exchange.collect()
        if self.checkpointer is not None and (m.step % self.cfg.train.checkpoint_every == 0 or self.save_due):
            if not self.checkpointer.busy():
                self.save(step + 1)
            elif not self.save_due:  # waiting would stall training for the rest of the previous write
                self.save_due = True
                log.info("checkpoint at step %d deferred: the previous write is still running; "
                         "saved after the first step that finds it done", m.step)  # fmt: skip
        return f"loss {m.loss:.4f} anchor_accept {m.anchor_accept:.2f} lr {m.lr:.2e}"

    def compile_ahead(self, batch: TargetBatch, item: int) -> None:
        """The step's forward and backward on `batch` (item `item` with stand-in features: the step's shapes
        and dtypes), for their compile alone: torch.compile's graphs and their kernels' first runs (inductor's
        autotuning included) happen here, while the rank would otherwise wait (loop.Run.train), instead of
        in the first step. Nothing of the run changes: no optimizer step or EMA, the gradients dropped, the
        anchors drawn as the step draws them but from a generator of its own, the global random streams
        restored. One process only: under DDP the stand-in's gradients would be averaged with the other
        drafters'."""
        if "forward" in self.drafter.__dict__:
            raise RuntimeError("compile_ahead runs in one process: this drafter is wrapped in DDP")
        generator = torch.Generator()
        generator.manual_seed(anchor_seed(self.cfg.data.seed, item))
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):  # timed and logged by its caller, after READY
            out = self._loss(batch, generator)
            out.loss.backward()
            float(out.loss.detach())  # its kernels have run
        self.optimizer.zero_grad(set_to_none=True)

    # -- checkpoints

    def state_dict(self, next_step: int) -> dict[str, Any]:
        next_item = next_step * self.num_drafters
        return {
            "trainer": {
                "drafter": self.drafter.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "step": self.step_count,
            },
            # Topology-free: the optimizer step and the next item of the global data order (in rows too, so
            # a different optim.batch still finds its place); `drafters` only says who wrote it.
            "position": {
                "step": self.step_count,
                "next_item": next_item,
                "rows": next_item * self.cfg.optim.batch,
                "drafters": self.num_drafters,
                "horizon": [self.horizon.total, self.horizon.unit],
            },
            "data": self.data_state(next_item) or {},
            "rng": rng_state(self.generator),
            "spec": self.spec.config_dict(),
            "config": self.cfg.to_dict(),
        }

    def save(self, next_step: int, *, final: bool = False) -> Path:
        """Snapshots the state and writes it in the background (leader only)."""
        assert self.checkpointer is not None and self.ema is not None
        ema = self.ema
        self.save_due, self.saved_step = False, self.step_count
        # The EMA is written live (frozen, not copied: 6.8 GB of host memory and a CPU copy in the stall).
        return self.checkpointer.save(
            self.step_count, self.state_dict(next_step), ema.freeze, release=ema.thaw, final=final
        )

    def resume_newest(self) -> tuple[Path, Position] | None:
        """Resumes from the newest complete checkpoint in `train.checkpoint_dir` (None: there is none yet)."""
        path = latest_checkpoint(self.cfg.train.checkpoint_dir)
        return None if path is None else (path, self.resume(path))

    def resume(self, path: Path) -> Position:
        """Loads a checkpoint of any topology (every drafter: the DDP replicas must start equal)."""
        start = time.perf_counter()
        with startup.phase("checkpoint read"):
            state, ema_state = load_checkpoint(path, ema=self.ema is not None)
        if "position" not in state:
            raise ValueError(
                f"{path}: a checkpoint of an older trainer (no position); start afresh or export it"
            )
        trainer = state["trainer"]
        with startup.phase("checkpoint onto the drafter"):  # device copies of weights and moments; EMA queued
            self.drafter.load_state_dict(trainer["drafter"])
            self.optimizer.load_state_dict(trainer["optimizer"])
            if self.ema is not None and ema_state is not None:
                self.ema.load_state_dict(ema_state)
        self.step_count = trainer["step"]
        set_rng_state(state["rng"], self.generator)
        pos = state["position"]
        next_item = -(-pos["rows"] // self.cfg.optim.batch)
        if self.leader:
            seconds = time.perf_counter() - start
            log.info("checkpoint loaded in %.1f s; resumed from %s (step %d)", seconds, path, self.step_count)
            if pos["drafters"] != self.num_drafters:
                log.info(
                    "%s was written by %d drafter rank(s), this run has %d: continuing at item %d",
                    path.name,
                    pos["drafters"],
                    self.num_drafters,
                    -(-next_item // self.num_drafters) * self.num_drafters,
                )
        return Position(self.step_count, next_item, state.get("data") or None)

    def finish(self, step: int) -> dict[str, Any]:
        """End of the run (or of an agreed stop) at pipeline step `step`: the final save, finished before
        this returns, so SIGTERM's checkpoint is on disk before the process exits."""
        path = None
        if self.checkpointer is not None:
            if self.last is not None and self.saved_step != self.last.step:
                self.save(step, final=True)
            path = self.checkpointer.wait()
        if self.last is None:
            return {"checkpoint": str(path) if path else None}
        # Summed on the device: a host copy in float64 (13.6 GB at the reference, twice over while
        # concatenated) gets the rank OOM-killed after its final save (docs/gpu-rehearsal.md).
        param_sum = torch.stack(
            [p.detach().sum(dtype=torch.float64) for p in self.drafter.parameters()]
        ).sum()
        # The last evaluation's figures (target rank 0 evaluates after the leader's hand-off).
        figures = self.exchange.collect(wait_s=300.0) if self.exchange is not None else {}
        self.last.eval = figures or self.last.eval
        return {
            "eval": self.last.eval,
            "loss": self.last.loss,
            "anchor_accept": self.last.anchor_accept,
            "steps": step,
            "param_sum": float(param_sum),
            "checkpoint": str(path) if path else None,
        }
