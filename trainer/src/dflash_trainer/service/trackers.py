"""Experiment trackers (tensorboard, wandb): optional, checked before the run, never able to stop training.

Each configured tracker is imported and checked to expose exactly the API this module calls (the first tmux
run died at start-up on a wandb API change after the models had loaded for a minute); preflight starts each
one offline into a temporary directory. During the run every call goes through `SafeTracker`: the first
failure logs ONE warning naming the tracker and the step, and that tracker is off for the rest of the run.

A tracker never holds the run back: each starts in a background thread and `start_trackers` waits for them
at most START_WAIT_S (tensorboard is ready well within it); values logged while one is still starting (wandb
behind a slow or unreachable server retries for up to WANDB_INIT_TIMEOUT_S) are kept and sent once it is up.
wandb is told to be silent and to leave the console alone, so the journal holds our lines, not its chatter.
"""

from __future__ import annotations

import collections
import inspect
import logging
import os
import re
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from dflash_trainer.config import TrainConfig

log = logging.getLogger("dflash_trainer.trackers")

# Characters wandb refuses in a project name.
_WANDB_BAD = re.compile(r"[/\\#?%:]")
# How long start_trackers waits for every tracker before the run goes on (READY is not held longer).
START_WAIT_S = 3.0
# wandb's own default is 90 s of retries against an unreachable server; in the background 60 s is plenty.
WANDB_INIT_TIMEOUT_S = 60.0
WANDB_FINISH_TIMEOUT_S = 30.0
# How long close() waits for a tracker that is still starting, and how many values it keeps meanwhile.
CLOSE_WAIT_S = 5.0
PENDING_MAX = 10_000
# wandb's console chatter (login banner, run URLs, retry notices) and its stdout capture, off at the source.
WANDB_QUIET_ENV = {"WANDB_SILENT": "true", "WANDB_CONSOLE": "off", "WANDB_DISABLE_CODE": "true"}


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
    ApiNeed("wandb.init", ("project", "name", "id", "dir", "mode", "config", "resume", "settings")),
    ApiNeed(
        "wandb.Settings",
        (
            "silent",
            "console",
            "init_timeout",
            "finish_timeout",
            "x_graphql_retry_max",
            "x_graphql_timeout_seconds",
        ),
    ),
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
        for key, value in WANDB_QUIET_ENV.items():  # read at import and by its service process
            os.environ.setdefault(key, value)
        import wandb

        run_dir = directory or cfg.train.checkpoint_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        settings = wandb.Settings(
            silent=True,
            console="off",
            init_timeout=WANDB_INIT_TIMEOUT_S,
            # Bounded at the end too: an unreachable server must not hold a stop (save, exit) for minutes.
            finish_timeout=WANDB_FINISH_TIMEOUT_S,
            # Its API calls (run creation, finish) retry a few times, not for a minute and more; metrics
            # stream on their own retry policy, unchanged.
            x_graphql_retry_max=3,
            x_graphql_timeout_seconds=10.0,
        )
        self.run = wandb.init(
            project=cfg.trackers.wandb_project,
            name=cfg.trackers.wandb_run,
            id=_wandb_run_id(run_dir),  # one wandb run across restarts of the unit
            dir=str(run_dir),
            mode=mode,
            config=cfg.to_dict(),
            resume="allow",
            settings=settings,
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
    """Wraps a tracker; its first exception logs one warning, then the tracker is off for good.

    `SafeTracker.starting(name, make)` builds the tracker in a background thread instead: values logged
    before it is up wait in a bounded queue and go out with the first call after it is.
    """

    def __init__(self, tracker: Tracker | None = None, *, name: str | None = None) -> None:
        self.tracker = tracker
        self.name = tracker.name if tracker is not None else str(name)
        self.failed: str | None = None
        self._pending: collections.deque[tuple[int, dict[str, float]]] = collections.deque(maxlen=PENDING_MAX)
        self._up = threading.Event()
        self._thread: threading.Thread | None = None
        if tracker is not None:
            self._up.set()

    @classmethod
    def starting(cls, name: str, make: Callable[[], Tracker]) -> SafeTracker:
        safe = cls(name=name)
        started = time.monotonic()

        def start() -> None:
            try:
                safe.tracker = make()
            except Exception as e:
                safe.failed = f"did not start: {type(e).__name__}: {e}"
                log.warning(
                    "tracker %s did not start (%s: %s); training goes on without it",
                    name,
                    type(e).__name__,
                    e,
                )
            else:
                log.info("tracker %s started in %.1f s", name, time.monotonic() - started)
            finally:
                safe._up.set()

        # A daemon thread: a tracker that never answers cannot keep the process from exiting.
        safe._thread = threading.Thread(target=start, name=f"tracker-{name}", daemon=True)
        safe._thread.start()
        return safe

    @property
    def ready(self) -> bool:
        return self._up.is_set()

    def wait(self, timeout: float) -> bool:
        return self._up.wait(timeout)

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

    def _flush(self) -> None:
        while self._pending and self.failed is None and self.tracker is not None:
            step, values = self._pending.popleft()
            self._guard(f"at step {step}", lambda s=step, v=values: self.tracker.log(s, v))

    def log(self, step: int, values: Mapping[str, float]) -> None:
        if self.failed is not None:
            return
        if not self._up.is_set():
            self._pending.append((step, dict(values)))
            return
        self._flush()
        self._guard(f"at step {step}", lambda: self.tracker.log(step, values))

    def close(self) -> None:
        if not self._up.wait(CLOSE_WAIT_S):
            log.warning(
                "tracker %s is still starting after %.0f s more; closing without it (%d values not sent)",
                self.name,
                CLOSE_WAIT_S,
                len(self._pending),
            )
            return
        if self.tracker is None:
            return
        self._flush()
        self._guard("on close", self.tracker.close)


def start_trackers(
    cfg: TrainConfig, *, environ: Mapping[str, str] | None = None, wait_s: float = START_WAIT_S
) -> list[SafeTracker]:
    """The run's trackers, each starting in the background; waits at most wait_s for them all, so no tracker
    holds READY back. One that cannot start logs one warning and is off (training goes on)."""
    env = os.environ if environ is None else environ
    started = []
    for name in configured(cfg):
        if name == "tensorboard":
            make: Callable[[], Tracker] = lambda: TensorboardTracker(cfg.trackers.tensorboard)  # noqa: E731
        else:
            make = lambda: WandbTracker(cfg, mode=env.get("WANDB_MODE"))  # noqa: E731
        started.append(SafeTracker.starting(name, make))
    deadline = time.monotonic() + wait_s
    for tracker in started:
        if not tracker.wait(max(0.0, deadline - time.monotonic())):
            log.info(
                "tracker %s is still starting after %.0f s; training goes on, its values are sent once it is",
                tracker.name,
                wait_s,
            )
    return started


def try_offline(cfg: TrainConfig, name: str, scratch: Path) -> None:
    """Preflight: starts the tracker offline in `scratch`, logs one value, closes it; raises on failure."""
    if name == "tensorboard":
        probe_dir_creatable(Path(cfg.trackers.tensorboard), "trackers.tensorboard")
        tracker: Tracker = TensorboardTracker(scratch / "tensorboard")
    else:
        tracker = WandbTracker(cfg, mode="offline", directory=scratch / "wandb")
    tracker.log(0, {"preflight": 1.0})
    tracker.close()


def probe_dir_creatable(target: Path, key: str) -> None:
    """Creates TARGET (and its missing parents) and a file in it, then removes what it made: the real test,
    where a permission bit test says yes to root on a read-only file system or under a regular file."""
    missing = [p for p in (target, *target.parents) if not p.exists()]
    top = missing[-1] if missing else None
    try:
        target.mkdir(parents=True, exist_ok=True)
        probe = target / f".dflash-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise TrackerError(f"{key} {target}: cannot be created or written ({e.strerror or e})") from None
    finally:
        if top is not None and top.is_dir():
            import shutil

            shutil.rmtree(top, ignore_errors=True)
