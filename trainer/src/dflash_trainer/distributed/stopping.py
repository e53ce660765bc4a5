"""A graceful stop of the pipeline (SIGTERM to any rank) with no point-to-point operation left unmatched.

The drafter leader decides: at the start of its step s it reads the job store's request counter (any rank
that got SIGTERM adds to it) and, when it is set, publishes the stop step S = s + 1 (S = s would strand the
other drafters already inside step s's gradient all-reduce). The other drafters read S at their next step
start: they cannot finish step s before the leader has begun it, so it is there. Targets read it before each
item. Drafters train steps < S; targets make real items < S*M.

What is in flight then is bounded without asking anyone: at their last step the drafters have posted receives
for every item below P = min(S - 1 + depth, stop) * M. A target sends item i only after its send of item
i - depth*N landed (a send completes when its receive is posted), and reads the stop step again right after
that wait: if the wait ended before the drain began, i - depth*N < P; if during it, the target now knows S.
So no item at or above P + depth*N is sent once S is out, and both sides finish at `drain_end`: targets send
empty items up to it, drafters post and discard receives up to it. Every send meets its receive, whatever the
timing; nothing is waited on that nobody will send.
"""

from __future__ import annotations

import threading

import torch.distributed as dist

REQUESTED = "stop/requested"
STEP = "stop/step"


def drain_end(stop_step: int, last_step: int, depth: int, num_targets: int, num_drafters: int) -> int:
    """The first item neither sent nor received after a stop at `stop_step` (run's steps end at last_step)."""
    posted = min(stop_step - 1 + depth, last_step) * num_drafters
    return min(posted + depth * num_targets, last_step * num_drafters)


class StopSignal:
    """One rank's view of the stop: `requested` is its own SIGTERM flag; the store is the job's."""

    def __init__(self, store: dist.Store, requested: threading.Event) -> None:
        self.store, self.requested = store, requested
        self._told = False
        self.step: int | None = None  # the agreed stop step, once known

    def _tell(self) -> None:
        if self.requested.is_set() and not self._told:
            self.store.add(REQUESTED, 1)
            self._told = True

    def poll(self) -> int | None:
        """Targets and drafters other than the leader: the stop step, once the leader has published it."""
        self._tell()
        if self.step is None and self.store.check([STEP]):
            self.step = int(self.store.get(STEP))
        return self.step

    def asked(self) -> bool:
        """Whether any rank of the job asked to stop (its own SIGTERM, or one on another node)."""
        self._tell()
        return self.store.add(REQUESTED, 0) > 0

    def decide(self, step: int, *, alone: bool = False) -> int | None:
        """The drafter leader at the start of `step`: publishes step + 1 when any rank asked to stop, or
        `step` itself when it is the only drafter (no other drafter can be inside step `step`)."""
        self._tell()
        if self.step is None and self.store.add(REQUESTED, 0) > 0:
            self.step = step if alone else step + 1
            self.store.set(STEP, str(self.step))
        return self.step
