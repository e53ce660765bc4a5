"""Training checkpoints: one directory per step, written atomically, the last K kept.

A checkpoint is `DIR/step-00001234/` holding `state.pt` (drafter weights, optimizer, scheduler, step, data
position, RNG states, config) and `ema.pt` (the CPU EMA). It is written into a temporary sibling and renamed,
so a crash mid-save leaves the previous checkpoints intact and no half-written one that looks complete.
Everything is saved as tensors and plain containers so loading uses torch.load(weights_only=True).
"""

from __future__ import annotations

import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

_STEP_DIR = re.compile(r"^step-(\d{8})$")


def rng_state(anchor_generator: torch.Generator) -> dict[str, Any]:
    np_state = np.random.get_state(legacy=False)
    return {
        "python": random.getstate(),
        "numpy": {
            "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "anchors": anchor_generator.get_state(),
    }


def set_rng_state(state: dict[str, Any], anchor_generator: torch.Generator) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state(("MT19937", n["key"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    anchor_generator.set_state(state["anchors"])


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _save(obj: Any, path: Path) -> None:
    with path.open("wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def list_checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    if not Path(directory).is_dir():
        return []
    found = [p for p in Path(directory).iterdir() if _STEP_DIR.match(p.name) and p.is_dir()]
    return sorted(found, key=lambda p: p.name)


def latest_checkpoint(directory: Path) -> Path | None:
    found = list_checkpoints(directory)
    return found[-1] if found else None


def save_checkpoint(
    directory: Path, step: int, state: dict[str, Any], ema: dict[str, Any], *, keep_last: int
) -> Path:
    """Writes step `step` and returns its directory; removes all but the last `keep_last` checkpoints."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"step-{step:08d}"
    tmp = directory / f".tmp-step-{step:08d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    _save(state, tmp / "state.pt")
    _save(ema, tmp / "ema.pt")
    _fsync_dir(tmp)
    if final.exists():  # the same step saved again (e.g. a stop right after a periodic save)
        shutil.rmtree(final)
    tmp.rename(final)
    _fsync_dir(directory)
    for old in list_checkpoints(directory)[:-keep_last]:
        shutil.rmtree(old)
    for stale in directory.glob(".tmp-step-*"):  # left by a process that died mid-save
        if stale != tmp:
            shutil.rmtree(stale, ignore_errors=True)
    return final


def load_checkpoint(path: Path, *, ema: bool = True) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(state, ema state or None), on the CPU."""
    path = Path(path)
    state = torch.load(path / "state.pt", map_location="cpu", weights_only=True)
    ema_state = torch.load(path / "ema.pt", map_location="cpu", weights_only=True) if ema else None
    return state, ema_state
