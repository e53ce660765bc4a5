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

    def newest_checkpoint(self) -> Checkpoint | None:
        return latest_checkpoint(self.checkpoint_dir) if self.checkpoint_dir is not None else None

    def checkpoints_on_disk(self) -> int | None:
        """Step directories in checkpoint_dir, a half-removed one included (it still holds disk)."""
        return len(step_dirs(self.checkpoint_dir)) if self.checkpoint_dir is not None else None


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


def latest_checkpoint(directory: Path) -> Checkpoint | None:
    names = step_dirs(directory)
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
