"""`TargetSide` (a target rank, or the target half of a single process): the frozen target, the data stream,
the capture that makes a TargetBatch, and the evaluation, which runs where the target lives
(dflash_trainer.evaluation.hooks); `EvalExchange` hands the drafter's weights to target rank 0 in a
pipeline."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from dflash_trainer import stack_sampler, startup
from dflash_trainer.config import TrainConfig
from dflash_trainer.data.batch import Batch, TargetBatch
from dflash_trainer.evaluation import hooks
from dflash_trainer.evaluation.hooks import EvalContext, EvalHook, eval_share
from dflash_trainer.evaluation.walk import KeptWalk
from dflash_trainer.logs import rank
from dflash_trainer.runtime import autocast
from dflash_trainer.train.schedule import eval_due
from dflash_trainer.train.setup import ItemStream, Setup, build_drafter

log = logging.getLogger("dflash_trainer.train")


def training_capture(target: Any, cfg: TrainConfig) -> Callable[..., TargetBatch]:
    """The target forward of a training step: `target.capture`, or with train.target_compile its compiled
    layers (model.target.CompiledCapture), on CUDA replayed from a CUDA graph per row-length bucket
    (model.target.GraphedCapture); the walk and the held-out figures call `target.capture` itself."""
    if not cfg.train.target_compile:
        return target.capture
    from dflash_trainer.model.target import CompiledCapture, GraphedCapture

    compiled = CompiledCapture(target, backend=cfg.train.compile_backend)
    return GraphedCapture(compiled) if target.device.type == "cuda" else compiled


class TargetSide:
    """A target rank's work (roles.Producer), and the evaluation: `evaluate(step, drafter)` runs the
    held-out figures and every hook of `eval_hooks` here, where the target is loaded."""

    def __init__(self, setup: Setup, *, evaluates: bool) -> None:
        self.setup, self.cfg, self.device = setup, setup.cfg, setup.device
        with startup.phase("target"):
            self.target = setup.make_target(self.cfg.drafter.target_layer_ids)
            self.capture = training_capture(self.target, self.cfg)
        with startup.phase("data stream"):
            self.rows = setup.make_rows()
        # Held-out rows are loaded wherever evaluation may run; train.eval_every says when it does.
        self.evaluates = evaluates and self.cfg.data.held_out > 0
        with startup.phase("held-out rows"):
            self.held_out = setup.held_out() if self.evaluates else []
        self.eval_hooks: list[EvalHook] = list(hooks.EVAL_HOOKS) if self.evaluates else []
        # train.eval_walk_keep: the decode walk's cache and CUDA graphs, from one evaluation to the next.
        self.kept_walk = KeptWalk() if self.cfg.train.eval_walk_keep else None
        # Told what an evaluation is doing while it runs (minutes on a 27B target); the service sets it.
        self.progress: Callable[[str], None] = lambda _text: None
        # Training time since the first forward or the last evaluation: an evaluation's share of the run.
        self._trained_since: float | None = None
        # The process's first evaluation is sampled (DFLASH_PROFILE_START) and says so in its log line.
        self._evaluated = False

    def start_at(self, item: int, data_state: dict[str, int] | None) -> None:
        stream = getattr(self.rows, "__self__", None)
        if isinstance(stream, ItemStream):
            stream.start_at(item, data_state)

    def load(self, item: int) -> Batch:
        return self.rows(item).to(self.device)

    def forward(self, batch: Batch) -> TargetBatch:
        if self._trained_since is None:
            self._trained_since = time.perf_counter()
        with autocast(self.cfg, self.device):
            out = self.capture(batch.input_ids, batch.attention_mask, batch.loss_mask)
        return TargetBatch(out.input_ids, out.loss_mask, out.context.to(self.setup.dtype))

    def stand_in(self, batch: Batch) -> TargetBatch:
        """What `forward(batch)` returns, its features random: the shapes and dtypes of the drafter's step,
        without running the target (DrafterSide.compile_ahead)."""
        rows, tokens = batch.input_ids.shape
        width = len(self.target.layer_ids) * self.target.hidden_size
        random = torch.Generator(self.device).manual_seed(0)  # the run's random streams stay untouched
        context = torch.randn(
            rows, tokens, width, device=self.device, dtype=self.setup.dtype, generator=random
        )
        return TargetBatch(batch.input_ids, batch.loss_mask.bool(), context)

    def evaluate(self, step: int, drafter: nn.Module) -> dict[str, float]:
        ctx = EvalContext(
            step, self.cfg, self.target, drafter, self.held_out, self.device,
            progress=lambda text: self.progress(f"evaluation at step {step}: {text}"),
            kept_walk=self.kept_walk,
        )  # fmt: skip
        figures: dict[str, float] = {}
        started = time.perf_counter()
        first, self._evaluated = not self._evaluated, True
        was_training = drafter.training
        drafter.eval()  # every hook sees the drafter as it serves
        window = [f"evaluation at step {step}: {hook.__name__}" for hook in self.eval_hooks]
        profile = stack_sampler.from_environment(window[0]) if first and window else None
        try:
            for i, hook in enumerate(self.eval_hooks):
                if profile is not None and i:  # a window per hook: where a first evaluation's seconds go
                    profile.mark(window[i])
                try:
                    figures |= hook(ctx)
                except (
                    Exception
                ) as e:  # an evaluation bug must not end a days-long run; the smoke fails on it
                    log.error("evaluation %s at step %d failed: %s: %s (training goes on)",
                              hook.__name__, step, type(e).__name__, e, exc_info=True)  # fmt: skip
                    figures[f"{hook.__name__}_failed"] = 1.0
        finally:
            drafter.train(was_training)
            if profile is not None:
                name = f"eval-profile-rank{rank()}.txt"
                log.info("evaluation profile: %s", stack_sampler.write_report(profile, name))
        seconds = time.perf_counter() - started
        trained = started - self._trained_since if self._trained_since is not None else 0.0
        self._trained_since = time.perf_counter()
        if figures:
            shown = " ".join(f"{k} {v:.4f}" for k, v in figures.items() if not k.startswith("acc_"))
            log.info("evaluation at step %d: %s", step, shown)
            log.info("evaluation at step %d took %s", step, eval_share(seconds, trained, first))
        return figures


class EvalExchange:
    """Evaluation in the pipeline: after each evaluation step the drafter leader hands its weights to target
    rank 0 (a broadcast in a two-rank group), which evaluates them against its own target and publishes the
    figures in the job's store; the leader attaches them to the metrics of a later step (trackers, log).

    The store orders it: the leader marks `eval/ready/P` before the broadcast, and target rank 0 only enters
    the broadcast once that mark is there, or leaves the evaluation out when the agreed stop step says the
    leader will never train pipeline step P. Target 0 does this before making its first item of a later
    step; its items up to P are all sent by then, so the leader, which needs them to finish step P, is never
    waiting on it."""

    def __init__(self, store: Any, group: Any, leader: int, offset: int, every: int, num_drafters: int):
        self.store, self.group, self.leader, self.offset = store, group, leader, offset
        self.every, self.num_drafters = every, num_drafters  # every: train.eval_every
        self._pending: list[int] = []  # optimizer steps whose figures the leader waits for

    def due(self, pipeline_step: int) -> bool:
        return eval_due(pipeline_step + 1 + self.offset, self.every)

    # the drafter leader
    def send(self, pipeline_step: int, drafter: nn.Module) -> None:
        self.store.set(f"eval/ready/{pipeline_step}", "1")
        for p in drafter.parameters():
            torch.distributed.broadcast(p.data, src=self.leader, group=self.group)
        self._pending.append(pipeline_step + 1 + self.offset)

    def collect(self, wait_s: float = 0.0) -> dict[str, float]:
        """Figures that have arrived since the last call; waits up to `wait_s` for the outstanding ones."""
        figures: dict[str, float] = {}
        deadline = time.monotonic() + wait_s
        while self._pending:
            if self.store.check([f"eval/figures/{self._pending[0]}"]):
                figures = json.loads(self.store.get(f"eval/figures/{self._pending.pop(0)}"))
            elif time.monotonic() < deadline:
                time.sleep(0.05)
            else:
                break
        return figures

    # target rank 0
    def receive_and_evaluate(
        self, pipeline_step: int, side: TargetSide, replica: nn.Module, stop_step: Callable[[], int | None]
    ) -> None:
        key = f"eval/ready/{pipeline_step}"
        while not self.store.check([key]):
            stop = stop_step()
            if stop is not None and pipeline_step >= stop:
                return  # the leader stops before this step: no weights will come
            time.sleep(0.01)
        for p in replica.parameters():
            torch.distributed.broadcast(p.data, src=self.leader, group=self.group)
        step = pipeline_step + 1 + self.offset
        figures = side.evaluate(step, replica)
        self.store.set(f"eval/figures/{step}", json.dumps(figures))


def eval_replica(side: TargetSide) -> nn.Module:
    """Target rank 0's copy of the drafter for evaluation: no optimizer, weights from the leader."""
    replica = build_drafter(side.cfg, side.target.config, side.device)
    return replica.requires_grad_(False)
