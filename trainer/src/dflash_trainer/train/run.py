"""The names distributed/ and service/ import from here; each lives in its own module (train.schedule,
train.setup, train.target_side, train.drafter_side, train.loop, fixtures.bench)."""

from dflash_trainer.fixtures.bench import setup_from_bench
from dflash_trainer.train.drafter_side import DrafterSide, find_resume
from dflash_trainer.train.loop import train
from dflash_trainer.train.schedule import Horizon, Position, horizon
from dflash_trainer.train.setup import autocast, head_only, setup_from_config
from dflash_trainer.train.target_side import EvalExchange, TargetSide, eval_replica, training_capture

__all__ = [
    "DrafterSide",
    "EvalExchange",
    "Horizon",
    "Position",
    "TargetSide",
    "autocast",
    "eval_replica",
    "find_resume",
    "head_only",
    "horizon",
    "setup_from_bench",
    "setup_from_config",
    "train",
    "training_capture",
]
