"""`train(cfg)`: a single process, i.e. the 1:1 pipeline with target and drafter in one process: the same
sides (train.target_side, train.drafter_side), the transport replaced by a call. distributed/launch.py runs
the sides on their own ranks."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash_trainer import startup
from dflash_trainer.config import TrainConfig
from dflash_trainer.device_memory import gpu_memory
from dflash_trainer.runtime import resolve_device
from dflash_trainer.train.drafter_side import DrafterSide, StepMetrics
from dflash_trainer.train.schedule import Position, eval_due, horizon
from dflash_trainer.train.setup import setup_from_config
from dflash_trainer.train.target_side import TargetSide

log = logging.getLogger("dflash_trainer.train")


Hook = Callable[[StepMetrics], None]


@dataclass
class TrainResult:
    step: int
    checkpoint: Path | None
    last: StepMetrics | None
    stopped: bool  # ended by the stop event, not by reaching the step limit


def log_line(m: StepMetrics) -> str:
    line = (
        f"step {m.step} loss {m.loss:.4f} lr {m.lr:.2e} grad {m.grad_norm:.2f} "
        f"anchor_accept {m.anchor_accept:.2f} tok/s {m.tokens_per_s:.0f}" + gpu_memory()
    )
    if m.eval:
        e = m.eval
        line += f" | held-out loss {e['loss']:.4f} anchor_accept {e['anchor_accept']:.2f}"
        if "walk_tau" in e:
            line += f" walk tau {e['walk_tau']:.2f} ({e['walk_steps']:.0f} verify steps, {e['walk_s']:.1f} s)"
    return line


class Run:
    """Target and drafter in one process: the 1:1 pipeline with the transport replaced by a call."""

    def __init__(self, cfg: TrainConfig, *, device: torch.device | None = None) -> None:
        self.cfg = cfg
        self.device = device or resolve_device(cfg)
        with startup.phase("data index"):
            self.setup = setup_from_config(cfg, self.device)
        self.target = TargetSide(self.setup, evaluates=True)
        self.horizon = horizon(cfg, self.setup.num_rows)
        self.drafter = DrafterSide(
            cfg, self.target.target, self.horizon, device=self.device, data_state=self.setup.data_state
        )
        self.position = Position()

    def resume(self) -> Path | None:
        found = self.drafter.resume_newest()
        if found is None:
            return None
        path, self.position = found
        return path

    def evaluate(self) -> dict[str, float]:
        return self.target.evaluate(self.drafter.step_count, self.drafter.drafter)

    def train(
        self,
        *,
        stop_at: int | None = None,
        hooks: Sequence[Hook] = (),
        stop: threading.Event | None = None,
        compile_ahead: Callable[[], bool] | None = None,
    ) -> TrainResult:
        """`compile_ahead`, asked before the first target forward: True compiles the drafter's step first
        (DrafterSide.compile_ahead), while the target's first kernel launch would wait anyway (the GPU probes
        beside a cold start, service.probes_beside)."""
        first, end, offset = self.position.span(self.horizon, 1, stop_at)
        self.target.start_at(first, self.position.data)
        log.info(
            "training a %d-layer drafter on %s in one process (1:1): step %d, to step %d",
            self.cfg.drafter.num_layers, self.device, first + offset, end + offset,
        )  # fmt: skip
        p = first
        last = time.perf_counter()
        while p < end and not (stop is not None and stop.is_set()):
            rows = self.target.load(p)
            if p == first and compile_ahead is not None and compile_ahead():
                started = time.perf_counter()
                self.drafter.compile_ahead(self.target.stand_in(rows), p)
                log.info("drafter step compiled ahead in %.1f s, before the target's first kernel launch",
                         time.perf_counter() - started)  # fmt: skip
            batch = self.target.forward(rows)
            self.drafter.step(p, p, batch)
            m = self.drafter.last
            assert m is not None
            if eval_due(m.step, self.cfg.train.eval_every):
                m.eval = self.evaluate()
            now = time.perf_counter()
            m.tokens_per_s = m.seq_tokens / (now - last) if now > last else 0.0
            last = now
            if m.step % self.cfg.train.log_every == 0 or m.eval:
                log.info("%s", log_line(m))
            for hook in hooks:
                hook(m)
            p += 1
        extra = self.drafter.finish(p)
        ckpt = extra.get("checkpoint")
        return TrainResult(
            step=self.drafter.step_count,
            checkpoint=Path(ckpt) if ckpt else None,
            last=self.drafter.last,
            stopped=p < end,
        )


def train(
    cfg: TrainConfig,
    *,
    max_steps: int | None = None,
    hooks: Sequence[Hook] = (),
    stop: threading.Event | None = None,
    on_ready: Callable[[], None] | None = None,
    progress: Callable[[str], None] | None = None,
    compile_ahead: Callable[[], bool] | None = None,
) -> TrainResult:
    """One process: trains until the horizon, or `max_steps` (a stop, not a new horizon), or `stop` is set.
    Resumes from the newest checkpoint; `on_ready` is called once models, data and checkpoint are loaded;
    `progress` hears what a long evaluation is doing while it runs; `compile_ahead`: see Run.train."""
    run = Run(cfg)
    if progress is not None:
        run.target.progress = progress
    run.resume()
    if on_ready is not None:
        on_ready()
    return run.train(stop_at=max_steps, hooks=hooks, stop=stop, compile_ahead=compile_ahead)
