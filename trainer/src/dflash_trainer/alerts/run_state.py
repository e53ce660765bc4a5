"""What the run looks like from outside the trainer: its configuration and its checkpoints (no torch)."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path

_STEP_DIR = re.compile(r"^step-(\d{8})$")  # checkpoint.py: complete checkpoints only


@dataclass(frozen=True)
class Checkpoint:
    step: int
    path: Path
    mtime: float

    def age_s(self, now: float | None = None) -> float:
        return max(0.0, (time.time() if now is None else now) - self.mtime)


@dataclass(frozen=True)
class TrainSettings:
    """What the alerts read of [train]; all None when the file does not load (a message still goes out)."""

    checkpoint_dir: Path | None = None
    checkpoint_every: int | None = None
    max_steps: int | None = None
    keep_last: int | None = None

    def checkpoints(self) -> tuple[Checkpoint | None, int | None]:
        """The newest checkpoint and the count of step directories in checkpoint_dir, a half-removed one
        included (it still holds disk), from one listing; (None, None) without a configuration."""
        if self.checkpoint_dir is None:
            return None, None
        dirs = step_dirs(self.checkpoint_dir)
        return newest_of(dirs), len(dirs)

    def newest_checkpoint(self) -> Checkpoint | None:
        return self.checkpoints()[0]


def train_settings(path: Path) -> TrainSettings:
    """[train] through the trainer's own loader: checkpoint_dir resolved as the trainer resolves it, defaults
    filled."""
    from dflash_trainer.config import ConfigError, check_tables, read_toml

    try:
        train = check_tables(read_toml(path), base=path.resolve().parent).train
    except (ConfigError, OSError):
        return TrainSettings()
    return TrainSettings(train.checkpoint_dir, train.checkpoint_every, train.max_steps, train.keep_last)


def step_dirs(directory: Path) -> list[Path]:
    """The `step-N` directories, oldest first; none where the directory cannot be read."""
    try:
        return sorted(p for p in directory.iterdir() if _STEP_DIR.match(p.name) and p.is_dir())
    except OSError:
        return []


def newest_of(names: list[Path]) -> Checkpoint | None:
    """The last of `step_dirs`' list, with the time its newest file was written."""
    if not names:
        return None
    newest = names[-1]
    files = [newest, *(p for p in newest.iterdir() if p.is_file())]
    mtime = max(p.stat().st_mtime for p in files)
    return Checkpoint(int(_STEP_DIR.match(newest.name).group(1)), newest, mtime)


def duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 120:
        return f"{seconds} s"
    if seconds < 7200:
        return f"{seconds // 60} min"
    return f"{seconds // 3600} h {seconds % 3600 // 60} min"
