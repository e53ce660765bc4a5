"""Per-rank time accounting, for the periodic log line, the summary table and the timeline.

States: busy (model compute), data (reading and collating rows), wait_send (a target blocked on
back-pressure), wait_recv (a drafter blocked on its next item). Whatever is left of the wall time is idle
(startup, logging, checkpoints). Intervals are kept in a bounded ring (the last `keep`) for the timeline;
totals are exact.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from dflash_trainer.device_memory import gpu_memory

STATES = ("busy", "data", "wait_send", "wait_recv")


@dataclass
class RankSummary:
    rank: int
    role: str
    device: str
    host: str
    wall_s: float
    items: int
    tokens: int
    seconds: dict[str, float]  # per state
    inflight_mean: float
    intervals: list[tuple[float, float, str]] = field(default_factory=list)  # absolute wall-clock times
    extra: dict[str, float | int | str] = field(default_factory=dict)
    # After the first `warmup_items` items (compilation, first communicator set-up): the steady state.
    steady_wall_s: float = 0.0
    steady_tokens: int = 0

    def fraction(self, state: str) -> float:
        return self.seconds.get(state, 0.0) / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def idle(self) -> float:
        return max(0.0, 1.0 - sum(self.fraction(s) for s in STATES))

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0


class RankMeter:
    def __init__(
        self, rank: int, role: str, device: str, host: str, *, keep: int = 4000, warmup_items: int = 0
    ) -> None:
        self.rank, self.role, self.device, self.host = rank, role, device, host
        self.warmup_items = warmup_items
        self._steady: tuple[float, int] | None = (time.time(), 0) if warmup_items == 0 else None
        self._last_count = time.time()
        self.start = time.time()
        self.seconds = dict.fromkeys(STATES, 0.0)
        self.intervals: deque[tuple[float, float, str]] = deque(maxlen=keep)
        self.items = 0
        self.tokens = 0
        self._inflight_sum = 0.0
        self._inflight_n = 0
        self._mark = (self.start, dict(self.seconds), 0, 0.0, 0)  # state at the last window report

    def restart(self) -> None:
        """Starts the clock after startup (model loading), so fractions describe the pipeline itself."""
        keep = self.intervals.maxlen or 4000
        self.__init__(self.rank, self.role, self.device, self.host, keep=keep, warmup_items=self.warmup_items)

    @contextlib.contextmanager
    def span(self, state: str) -> Iterator[None]:
        begin = time.time()
        try:
            yield
        finally:
            end = time.time()
            self.seconds[state] += end - begin
            self.intervals.append((begin, end, state))

    def count(self, tokens: int, items: int = 1) -> None:
        self.tokens += tokens
        self.items += items
        self._last_count = time.time()
        if self._steady is None and self.items >= self.warmup_items:
            self._steady = (self._last_count, self.tokens)

    def inflight(self, depth: int) -> None:
        self._inflight_sum += depth
        self._inflight_n += 1

    def window(self) -> str:
        """One log line about the time since the previous call."""
        now = time.time()
        t0, secs0, tok0, infl0, n0 = self._mark
        span = max(now - t0, 1e-9)
        frac = {s: (self.seconds[s] - secs0[s]) / span for s in STATES}
        depth = (self._inflight_sum - infl0) / max(1, self._inflight_n - n0)
        self._mark = (now, dict(self.seconds), self.tokens, self._inflight_sum, self._inflight_n)
        return (
            f"busy {frac['busy']:.0%} data {frac['data']:.0%} wait_send {frac['wait_send']:.0%} "
            f"wait_recv {frac['wait_recv']:.0%} in-flight {depth:.1f} tok/s {(self.tokens - tok0) / span:.0f}"
            + gpu_memory()
        )

    def summary(self, **extra: float | int | str) -> RankSummary:
        now = time.time()
        # The steady window ends at the last item, not after the final checkpoint save and teardown.
        steady_start, steady_tokens0 = self._steady or (now, self.tokens)
        return RankSummary(
            rank=self.rank,
            role=self.role,
            device=self.device,
            host=self.host,
            wall_s=time.time() - self.start,
            items=self.items,
            tokens=self.tokens,
            seconds=dict(self.seconds),
            inflight_mean=self._inflight_sum / max(1, self._inflight_n),
            intervals=list(self.intervals),
            extra=dict(extra),
            steady_wall_s=self._last_count - steady_start if self._steady else 0.0,
            steady_tokens=self.tokens - steady_tokens0,
        )


def pipeline_tokens_per_s(summaries: list[RankSummary]) -> float:
    """Tokens trained per second by all drafters together over the longest drafter steady-state wall time
    (the whole run when no warm-up was asked for)."""
    drafters = [s for s in summaries if s.role == "drafter"]
    wall = max((s.steady_wall_s for s in drafters), default=0.0)
    return sum(s.steady_tokens for s in drafters) / wall if wall > 0 else 0.0


def summary_table(summaries: list[RankSummary]) -> str:
    head = (
        "rank",
        "role",
        "device",
        "host",
        "items",
        "tok/s",
        "busy",
        "data",
        "w_send",
        "w_recv",
        "idle",
        "infl",
    )
    rows = [
        (
            str(s.rank),
            s.role,
            s.device,
            s.host,
            str(s.items),
            f"{s.tokens_per_s:.0f}",
            *(f"{s.fraction(k):.0%}" for k in STATES),
            f"{s.idle:.0%}",
            f"{s.inflight_mean:.1f}",
        )
        for s in sorted(summaries, key=lambda s: s.rank)
    ]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in [head, *rows]]
    lines.append(f"pipeline: {pipeline_tokens_per_s(summaries):.0f} tokens/s trained")
    return "\n".join(lines)


def write_metrics(summaries: list[RankSummary], path: Path) -> None:
    """The job's figures as JSON (`--metrics-out`): the pipeline's rate and each rank's summary, its
    intervals left out (the timeline's)."""
    data = {
        "pipeline_tokens_per_s": pipeline_tokens_per_s(summaries),
        "ranks": [{k: v for k, v in dataclasses.asdict(s).items() if k != "intervals"} for s in summaries],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))
