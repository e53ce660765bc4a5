"""The run's figures, read from the trainer's journal lines as they come (a pure parser, no torch).

The lines (service/logs.py prefixes each with `rank R ROLE: `):
- a drafter rank:  `step N: loss L anchor_accept A lr X | busy B% data D% wait_send S% wait_recv W%
  in-flight F tok/s T` (distributed/roles.py run_drafter, train/drafter_side.py DrafterSide.step)
- a target rank:   `item N: busy B% ... tok/s T` (roles.py run_target)
- one process:     `step N loss L lr X grad G anchor_accept A tok/s T[ | held-out loss ... walk tau W (...)]`
  (train/loop.py log_line)
- evaluations:     `evaluation at step N: ... walk_tau W ...` (evaluation/hooks.py)
- start-up:        `preflight passed in S s` (service/preflight.py), `ready: ...; S s after this rank's
  process started ..., S s after the launcher started` (service/run.py)
"""

from __future__ import annotations

import itertools
import re
from collections import deque
from dataclasses import dataclass, field

from dflash_trainer.alerts.classify import _split

STATES = ("busy", "data", "wait_send", "wait_recv")
_WINDOW = re.compile(
    r"busy (\d+)% data (\d+)% wait_send (\d+)% wait_recv (\d+)% in-flight ([\d.]+) tok/s (\d+)"
    r"(?: gpu_mem ([\d.]+)/([\d.]+) GiB)?"
)
_PIPE_STEP = re.compile(r"^step (\d+): loss ([\d.eE+-]+|nan|inf)")
_ONE_STEP = re.compile(
    r"^step (\d+) loss ([\d.eE+-]+|nan|inf) .*?tok/s (\d+)(?: gpu_mem ([\d.]+)/([\d.]+) GiB)?"
)
_END = re.compile(r"^(?:stopped|finished) at step (\d+)|resumed from .*\(step (\d+)\)")
_TAU = re.compile(r"walk[ _]tau ([\d.]+)")
_EVAL = re.compile(r"^evaluation at step (\d+):")
_PREFLIGHT = re.compile(r"^preflight (?:passed|FAILED).* in ([\d.]+) s")
_READY = re.compile(
    r"^ready: .*?([\d.]+) s after the launcher started|^ready: .*?; ([\d.]+) s after this rank"
)


@dataclass
class RankFigures:
    role: str
    tokens_per_s: float = 0.0
    shares: dict[str, float] = field(default_factory=dict)  # busy, data, wait_send, wait_recv, idle
    at: float = 0.0
    gpu_allocated_gib: float | None = None  # CUDA memory of the rank, from its window line
    gpu_reserved_gib: float | None = None


@dataclass
class Figures:
    """What the journal said last, and the run's throughput history (the leader's step lines)."""

    step: int | None = None
    step_at: float | None = None  # when the newest step line was written
    loss: float | None = None
    walk_tau: float | None = None
    walk_tau_step: int | None = None
    preflight_s: float | None = None
    start_s: float | None = None
    ranks: dict[int, RankFigures] = field(default_factory=dict)
    # (time, step, pipeline tokens/s) of each leader line; the median is the run's own (restarts included)
    history: deque[tuple[float, int, float]] = field(default_factory=lambda: deque(maxlen=5000))
    invocation: str = ""
    started_at: float | None = None  # the current invocation's first line

    def pipeline_tokens_per_s(self) -> float:
        """Tokens trained per second by all drafter ranks (the one process's own rate)."""
        trainers = [r for r in self.ranks.values() if r.role in ("drafter", "trainer")]
        return sum(r.tokens_per_s for r in trainers)

    def feed(self, line: str, at: float, invocation: str = "") -> None:
        if invocation and invocation != self.invocation:
            self.invocation, self.started_at = invocation, at
            self.ranks.clear()  # a new start: the ranks' windows begin again
        rank, role, level, text = _split(line)
        if m := _PREFLIGHT.match(line):
            self.preflight_s = float(m.group(1))
            return
        if rank is None or level:
            return
        if m := _END.search(text):  # a stop's or a resume's step: no rate with it
            self.step = int(m.group(1) or m.group(2))
            return
        if m := _READY.match(text):
            self.start_s = float(m.group(1) or m.group(2))
            return
        if (m := _TAU.search(text)) and (e := _EVAL.match(text) or _ONE_STEP.match(text)):
            self.walk_tau, self.walk_tau_step = float(m.group(1)), int(e.group(1))
        leader = False
        if m := _ONE_STEP.match(text):
            self.step, self.loss, leader = int(m.group(1)), float(m.group(2)), True
            allocated, reserved = (float(g) if g else None for g in m.group(4, 5))
            self.ranks[rank] = RankFigures(role or "trainer", float(m.group(3)), {}, at, allocated, reserved)
        elif m := _PIPE_STEP.match(text):
            self.step, self.loss, leader = int(m.group(1)), float(m.group(2)), True
        if w := _WINDOW.search(text):
            shares = {s: int(w.group(i + 1)) / 100 for i, s in enumerate(STATES)}
            shares["idle"] = round(max(0.0, 1.0 - sum(shares.values())), 2)
            allocated, reserved = (float(g) if g else None for g in w.group(7, 8))
            self.ranks[rank] = RankFigures(role or "?", float(w.group(6)), shares, at, allocated, reserved)
        if leader and self.step is not None:
            self.step_at = at
            self.history.append((at, self.step, self.pipeline_tokens_per_s()))

    def median_tokens_per_s(self) -> float | None:
        rates = sorted(r for _, _, r in self.history if r > 0)
        return rates[len(rates) // 2] if rates else None

    def median_step_s(self) -> float | None:
        """Seconds per step, the median over consecutive leader lines of one start."""
        h = list(self.history)
        per = sorted(
            (b[0] - a[0]) / (b[1] - a[1]) for a, b in itertools.pairwise(h) if b[1] > a[1] and b[0] > a[0]
        )
        return per[len(per) // 2] if per else None
