"""`serve --pause-at STEP`: the operator harness's pause, composed around the production step hook.

The smoke run (roles/trainer_service dflash-smoke) and the GPU rehearsal (service/rehearse.py) need the job to
stand still at a known step so that they can stop it there, as `systemctl stop` would, and start it again to
check the resume (docs/service.md "The smoke run"). serve.py wraps its ServiceHooks in PauseAt only when the
flag is given; a production start has no pause in its step hook.

Paused, the drafter leader says so in STATUS (the harnesses wait for PAUSED in it), keeps feeding the watchdog
and, on a job of several nodes, the relay's beat (the other nodes' units hear it is alive), until SIGTERM on
this rank or a stop asked on any node; the ranks then agree on the stop step as for any stop
(distributed/stopping.py) and the leader saves at the paused step.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from dflash_trainer.service.notify import Notifier

log = logging.getLogger("dflash_trainer.service")

PAUSED = "paused"  # in the STATUS line the harnesses wait for (dflash-smoke.sh.j2, rehearse.py run_phase)


class PauseAt:
    """The step hook with a pause after step `step`: the inner (production) hook reports the step first."""

    def __init__(
        self, inner: Callable[[Any], None], step: int, notifier: Notifier, stop: threading.Event
    ) -> None:
        self.inner, self.step, self.notifier, self.stop = inner, step, notifier, stop
        # Several nodes, the drafter leader: the relay's beat and the job's stop-asked check (attach_relay).
        self.beat: Callable[[], None] | None = None
        self.stop_asked: Callable[[], bool] | None = None

    def attach_relay(self, beat: Callable[[], None], stop_asked: Callable[[], bool]) -> None:
        """Several nodes, the drafter leader (distributed/rank.py's Control.on_relay)."""
        self.beat, self.stop_asked = beat, stop_asked

    def __call__(self, m: Any) -> None:
        self.inner(m)
        if m.step == self.step:
            self.wait(m.step)

    def wait(self, step: int) -> None:
        """Until SIGTERM (the stop event) or a stop asked on another node, pinging the watchdog meanwhile."""
        self.notifier.status(f"step {step}: {PAUSED} for the smoke run's stop")
        log.info("paused at step %d until stopped (smoke run)", step)
        every = max(0.2, (self.notifier.watchdog_s or 2.0) / 4)
        while not self.stop.wait(every if self.stop_asked is None else min(every, 1.0)):
            self.notifier.watchdog(force=True)
            if self.beat is not None:
                self.beat()
            if self.stop_asked is not None and self.stop_asked():
                break  # the ranks agree on the stop step at the next step start (stopping.py)
