"""Experiment trackers (tensorboard, wandb): optional, checked before the run, never able to stop training.

Each configured tracker is imported and checked to expose exactly the API this module calls (the first tmux
run died at start-up on a wandb API change after the models had loaded for a minute); preflight starts each
one offline into a temporary directory. During the run every call goes through `SafeTracker`: the first
failure logs ONE warning naming the tracker and the step, and that tracker is off for the rest of the run.
"""

from __future__ import annotations

import inspect
import logging
import os
import re
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from dflash_trainer.config import TrainConfig

log = logging.getLogger("dflash_trainer.trackers")

# Characters wandb refuses in a project name.
_WANDB_BAD = re.compile(r"[/\\#?%:]")


class TrackerError(RuntimeError):
    """A tracker that cannot be used; the message names the setting and the fix."""


class Tracker(Protocol):
    name: str

    def log(self, step: int, values: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class ApiNeed:
    """One callable the code calls, and the keyword parameters it passes."""

    where: str
    params: tuple[str, ...]


WANDB_NEEDS = (
    ApiNeed("wandb.init", ("project", "name", "id", "dir", "mode", "config", "resume")),
    ApiNeed("wandb.Run.log", ("data", "step")),
    ApiNeed("wandb.Run.finish", ()),
)
TENSORBOARD_NEEDS = (
    ApiNeed("torch.utils.tensorboard.SummaryWriter", ("log_dir",)),
    ApiNeed("torch.utils.tensorboard.SummaryWriter.add_scalar", ("tag", "scalar_value", "global_step")),
    ApiNeed("torch.utils.tensorboard.SummaryWriter.flush", ()),
    ApiNeed("torch.utils.tensorboard.SummaryWriter.close", ()),
)


def _resolve(dotted: str) -> Any:
    import importlib

    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(f"no module {parts[0]}")


def check_api(needs: tuple[ApiNeed, ...]) -> list[str]:
    """Mismatches between what the code calls and what the installed package offers (empty: all there)."""
    problems = []
    for need in needs:
        try:
            fn: Callable[..., Any] = _resolve(need.where)
        except (ImportError, AttributeError) as e:
            problems.append(f"{need.where} missing ({e})")
            continue
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):
            continue  # a builtin without a signature: nothing to compare
        params = sig.parameters
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            continue
        missing = [p for p in need.params if p not in params]
        if missing:
            problems.append(f"{need.where}{sig} takes no {', '.join(missing)}")
    return problems


def wandb_settings_problems(cfg: TrainConfig, environ: Mapping[str, str]) -> list[str]:
    """Setting mistakes, each naming the key and its fix."""
    t = cfg.trackers
    problems = []
    if t.wandb_project is not None:
        if not t.wandb_project.strip() or _WANDB_BAD.search(t.wandb_project) or len(t.wandb_project) > 128:
            problems.append(
                f"trackers.wandb_project {t.wandb_project!r} is not a valid wandb project name "
                "(no / \\ # ? % :, at most 128 characters)"
            )
        mode = environ.get("WANDB_MODE", "online")
        if mode not in ("online", "offline", "disabled", "shared", "dryrun", "run"):
            problems.append(f"WANDB_MODE={mode!r} is not a wandb mode (online, offline, disabled)")
        elif mode in ("online", "shared", "run") and not environ.get("WANDB_API_KEY"):
            problems.append(
                "wandb is online but WANDB_API_KEY is not set (put it in /etc/dflash/secrets.env)"
            )
    elif t.wandb_run is not None:
        problems.append("trackers.wandb_run is set without trackers.wandb_project")
    return problems


def configured(cfg: TrainConfig) -> list[str]:
    t = cfg.trackers
    return [
        name for name, on in (("tensorboard", t.tensorboard is not None), ("wandb", t.wandb_project)) if on
    ]


class TensorboardTracker:
    name = "tensorboard"

    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        Path(log_dir).mkdir(parents=True, exist_ok=True)
        self.log_dir = Path(log_dir)
        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, step: int, values: Mapping[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(tag=key, scalar_value=value, global_step=step)
        self.writer.flush()  # surfaces a failed background write now, in this call, not never

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    name = "wandb"

    def __init__(self, cfg: TrainConfig, *, mode: str | None = None, directory: Path | None = None) -> None:
        import wandb

        run_dir = Path(directory) if directory else Path(cfg.train.checkpoint_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=cfg.trackers.wandb_project,
            name=cfg.trackers.wandb_run,
            id=_wandb_run_id(run_dir),  # one wandb run across restarts of the unit
            dir=str(run_dir),
            mode=mode,
            config=cfg.to_dict(),
            resume="allow",
        )

    def log(self, step: int, values: Mapping[str, float]) -> None:
        self.run.log(data=dict(values), step=step)

    def close(self) -> None:
        self.run.finish()


def _wandb_run_id(directory: Path) -> str:
    path = directory / "wandb-run-id"
    if path.exists():
        return path.read_text().strip()
    run_id = uuid.uuid4().hex[:12]
    path.write_text(run_id + "\n")
    return run_id


class SafeTracker:
    """Wraps a tracker; its first exception logs one warning, then the tracker is off for good."""

    def __init__(self, tracker: Tracker) -> None:
        self.tracker = tracker
        self.name = tracker.name
        self.failed: str | None = None

    def _guard(self, what: str, fn: Callable[[], None]) -> None:
        if self.failed is not None:
            return
        try:
            fn()
        except Exception as e:
            self.failed = f"{type(e).__name__}: {e}"
            log.warning(
                "tracker %s failed %s: %s; it is off for the rest of this run, training goes on",
                self.name,
                what,
                self.failed,
            )

    def log(self, step: int, values: Mapping[str, float]) -> None:
        self._guard(f"at step {step}", lambda: self.tracker.log(step, values))

    def close(self) -> None:
        self._guard("on close", self.tracker.close)


def start_trackers(cfg: TrainConfig, *, environ: Mapping[str, str] | None = None) -> list[SafeTracker]:
    """The run's trackers; one that cannot start logs one warning and is left out (training goes on)."""
    env = os.environ if environ is None else environ
    started = []
    for name in configured(cfg):
        try:
            if name == "tensorboard":
                tracker: Tracker = TensorboardTracker(cfg.trackers.tensorboard)
            else:
                tracker = WandbTracker(cfg, mode=env.get("WANDB_MODE"))
        except Exception as e:
            log.warning(
                "tracker %s did not start (%s: %s); training goes on without it", name, type(e).__name__, e
            )
            continue
        log.info("tracker %s started", name)
        started.append(SafeTracker(tracker))
    return started


def try_offline(cfg: TrainConfig, name: str, scratch: Path) -> None:
    """Preflight: starts the tracker offline in `scratch`, logs one value, closes it; raises on failure."""
    if name == "tensorboard":
        target = Path(cfg.trackers.tensorboard)
        probe = target if target.exists() else next((p for p in target.parents if p.exists()), Path("/"))
        if not os.access(probe, os.W_OK):
            raise TrackerError(f"trackers.tensorboard {target}: {probe} is not writable")
        tracker: Tracker = TensorboardTracker(scratch / "tensorboard")
    else:
        tracker = WandbTracker(cfg, mode="offline", directory=scratch / "wandb")
    tracker.log(0, {"preflight": 1.0})
    tracker.close()
