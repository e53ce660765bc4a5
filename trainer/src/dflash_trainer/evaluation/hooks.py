"""The evaluations a TargetSide runs where the target lives: the held-out figures and the decode walk, each a
hook of `EVAL_HOOKS` that takes an `EvalContext` and returns figures."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dflash_trainer.config import TrainConfig
from dflash_trainer.data.batch import Batch
from dflash_trainer.evaluation.held_out import evaluate, first_rows, walk_prompts
from dflash_trainer.evaluation.walk import KeptWalk, WalkSettings, decode_walk, stop_token_ids
from dflash_trainer.runtime import autocast, objective_config


@dataclass
class EvalContext:
    """What an evaluation gets: the frozen target, the drafter at `step` (read only), the held-out rows."""

    step: int
    cfg: TrainConfig
    target: Any  # model.target.TargetModel
    drafter: nn.Module
    held_out: list[Batch]
    device: torch.device
    # What a long evaluation is doing, said as it goes (TargetSide.progress: the service's heartbeat).
    progress: Callable[[str], None] = lambda _text: None
    # The walk's cache and graphs from the last evaluation, kept for this one (train.eval_walk_keep).
    kept_walk: KeptWalk | None = None


EvalHook = Callable[[EvalContext], dict[str, float]]


def held_out_figures(ctx: EvalContext) -> dict[str, float]:
    """Token-weighted held-out loss, per-anchor acceptance (`anchor_accept`) and per-position accuracy."""
    with autocast(ctx.cfg, ctx.device):  # the drafter is in eval mode (TargetSide.evaluate)
        rows = first_rows(ctx.held_out, ctx.cfg.train.eval_rows)
        result = evaluate(ctx.drafter, ctx.target, rows, objective_config(ctx.cfg))
    return result.as_dict()


def walk_figures(ctx: EvalContext) -> dict[str, float]:
    """The decode walk (dflash_trainer.evaluation.walk): `walk_tau`, the acceptance length serving reports."""
    t = ctx.cfg.train
    prompts = walk_prompts(ctx.held_out, t.eval_walk_prompts, t.eval_walk_prompt_len)
    if not prompts:
        return {}
    model = ctx.target.model
    settings = WalkSettings(
        max_new_tokens=t.eval_walk_new_tokens, stop_token_ids=stop_token_ids(model), progress=ctx.progress
    )
    with autocast(ctx.cfg, ctx.device):
        return decode_walk(model, ctx.drafter, prompts, settings, ctx.kept_walk).as_dict()


def eval_share(seconds: float, trained_s: float, first: bool = False) -> str:
    """An evaluation's cost as the operator weighs it: its seconds and its share of the time since the last
    one (training and evaluation together). `first`: the process's first evaluation, which also compiles the
    drafter for evaluation and builds the walk's graphs (docs/acceptance.md#what-it-costs), so its share is
    not the steady one."""
    if trained_s <= 0:
        return f"{seconds:.1f} s"
    total = seconds + trained_s
    share = f"{seconds:.1f} s, {100 * seconds / total:.1f} % of the {total:.0f} s since"
    if first:
        return f"{share} training began (the first evaluation of this process: its compiles and graphs, once)"
    return f"{share} the last"


# Every evaluation a TargetSide runs, in order; each returns figures (merged, logged, sent to the trackers as
# eval/<name>). Append a hook here to add one (it runs on target rank 0, or in the single process).
EVAL_HOOKS: list[EvalHook] = [held_out_figures, walk_figures]
