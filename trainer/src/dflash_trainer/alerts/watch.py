"""Stall, slowdown and stale-checkpoint decisions over the run's figures (pure: time and state passed in).

- slow: the pipeline's tokens/s, every sample of the last `minutes`, below `share` x the run's median.
- stalled: no step line for `minutes` while the unit is active (after READY; the watchdog catches a hung step
  within WatchdogSec, this catches a job that is alive but makes no progress).
- no_checkpoint: the newest checkpoint older than `intervals` x checkpoint_every x the median step time (at
  least a minute).
- old_checkpoints: more than keep_last + 1 checkpoints on disk. A save writes the new one, then removes the
  oldest; one that will not go (a process holds it open on NFS) is retried at the next save, so one extra is
  normal, two mean the removal keeps failing and the disk fills past what preflight's disk check counted.
Each alerts once per episode and re-arms when the condition clears.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dflash_trainer.alerts.figures import Figures
from dflash_trainer.alerts.run_state import duration

WATCH_EVENTS = ("stalled", "slow", "no_checkpoint", "old_checkpoints")
MIN_CHECKPOINT_LIMIT_S = 60.0  # a checkpoint every few seconds (the lab's) is not held to the second


@dataclass
class Thresholds:
    share: float = 0.5
    minutes: float = 10.0
    intervals: float = 2.0
    checkpoint_every: int | None = None
    keep_last: int | None = None


@dataclass
class Alerting:
    raised: set[str] = field(default_factory=set)

    def edge(self, kind: str, on: bool) -> bool:
        """True when `kind` just became true."""
        if on and kind not in self.raised:
            self.raised.add(kind)
            return True
        if not on:
            self.raised.discard(kind)
        return False


def check(
    f: Figures,
    t: Thresholds,
    now: float,
    *,
    active: bool,
    checkpoint_at: float | None,
    alerting: Alerting,
    checkpoints_on_disk: int | None = None,
) -> list[tuple[str, str]]:
    """(event, what) for each condition that just began."""
    out: list[tuple[str, str]] = []
    window = t.minutes * 60
    progress = max(f.step_at or 0.0, f.started_at or 0.0)  # the newest step line, or this start
    stalled = active and f.started_at is not None and now - progress > window
    if alerting.edge("stalled", stalled):
        last = f"step {f.step}" if f.step is not None else "no step yet"
        out.append(("stalled", f"no training step for {t.minutes:g} min while the unit is active ({last})"))
    median = f.median_tokens_per_s()
    recent = [r for at, _, r in f.history if at >= now - window]
    covered = f.started_at is not None and now - f.started_at >= window and len(recent) >= 2
    slow = bool(active and covered and median and recent and max(recent) < t.share * median)
    if alerting.edge("slow", slow):
        out.append((
            "slow",
            f"pipeline at {max(recent):.0f} tokens/s or less for {t.minutes:g} min, below {t.share:.0%} of "
            f"the run's median {median:.0f} tokens/s",
        ))  # fmt: skip
    step_s = f.median_step_s()
    stale = False
    if active and t.checkpoint_every and step_s and f.started_at is not None:
        limit = max(MIN_CHECKPOINT_LIMIT_S, t.intervals * t.checkpoint_every * step_s)
        reference = max(checkpoint_at or 0.0, f.started_at)
        stale = now - reference > limit
    if alerting.edge("no_checkpoint", stale):
        age = now - (checkpoint_at or f.started_at or now)
        out.append((
            "no_checkpoint",
            f"no checkpoint for {duration(age)}: more than {t.intervals:g} x checkpoint_every "
            f"({t.checkpoint_every} steps x {step_s:.2f} s)",
        ))  # fmt: skip
    piling = (
        t.keep_last is not None and checkpoints_on_disk is not None and checkpoints_on_disk > t.keep_last + 1
    )
    if alerting.edge("old_checkpoints", piling):
        out.append((
            "old_checkpoints",
            f"{checkpoints_on_disk} checkpoints on disk, train.keep_last is {t.keep_last}: the older ones "
            "were not removed (`checkpoint step-N not removed yet` in the journal says why)",
        ))  # fmt: skip
    return out
