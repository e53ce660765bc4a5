"""Where a run is in its schedule, in terms that do not depend on the topology: `Horizon` (where the
schedule ends, in optimizer steps or in items), `Position` (where a run continues), the learning rate
(warmup + cosine), the anchor seed of an item and when an evaluation is due.

Anchors are drawn from a generator seeded by the item number, so whichever drafter trains an item, before or
after a restart, draws the same anchors: a resume under the same topology is bit-exact; a checkpoint of 1
process, 1:1, 5:3 or 4:4 resumes under any other."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from dflash_trainer.config import OptimConfig, TrainConfig


def lr_factor(done: int, *, total: int, warmup: int, schedule: str, min_ratio: float) -> float:
    """Linear warmup over `warmup` units, then cosine from 1 down to min_ratio at `total` (or constant)."""
    if done < warmup:
        return (done + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (done - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def anchor_seed(seed: int, item: int) -> int:
    return (seed * 1_000_003 + item) % (1 << 63)


@dataclass(frozen=True)
class Horizon:
    """The schedule's length: train.max_steps optimizer steps, else optim.epochs over the data in items.

    In items, M drafters consume M items a step, so a run resumed under another topology keeps its place in
    the schedule and ends after the same data; in steps (smoke runs, tests) the step count is the position.
    """

    total: int
    unit: Literal["steps", "items"]

    def done(self, step: int, items: int) -> int:
        return step if self.unit == "steps" else items

    def lr_factor(self, step: int, items: int, optim: OptimConfig) -> float:
        return lr_factor(
            self.done(step, items),
            total=self.total,
            warmup=max(1, round(optim.warmup_ratio * self.total)) if optim.warmup_ratio else 0,
            schedule=optim.schedule,
            min_ratio=optim.min_lr_ratio,
        )


def horizon(cfg: TrainConfig, num_rows: int | None) -> Horizon:
    if cfg.train.max_steps is not None:
        return Horizon(cfg.train.max_steps, "steps")
    if num_rows is None:
        raise ValueError("endless data needs train.max_steps")
    return Horizon(math.ceil(cfg.optim.epochs * num_rows / cfg.optim.batch), "items")


@dataclass(frozen=True)
class Position:
    """Where a run continues: optimizer steps done, and the first item of the global order not trained."""

    step: int = 0
    next_item: int = 0
    data: dict[str, int] | None = field(default=None, compare=False)  # the saved reader position, checked

    def span(self, hz: Horizon, num_drafters: int, stop_at: int | None) -> tuple[int, int, int]:
        """(first pipeline step, end pipeline step, optimizer step minus pipeline step)

        Pipeline step p trains items [p*M, (p+1)*M). Under a topology whose M does not divide next_item,
        the run starts at the next multiple (skipping fewer than M items of the epoch). `stop_at` stops the
        run at that optimizer step without changing the schedule."""
        m = num_drafters
        first = -(-self.next_item // m)
        # In steps the optimizer step count ends the run; in items, the last item of the data.
        end = first + max(0, hz.total - self.step) if hz.unit == "steps" else max(first, -(-hz.total // m))
        if stop_at is not None:
            end = min(end, first + max(0, stop_at - self.step))
        return first, end, self.step - first


def eval_due(optimizer_step: int, every: int) -> bool:
    """Whether an evaluation follows this optimizer step (every: train.eval_every, 0 for never)."""
    return bool(every) and optimizer_step > 0 and optimizer_step % every == 0
