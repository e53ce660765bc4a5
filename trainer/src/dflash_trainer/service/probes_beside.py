"""The GPU probes beside a rank's start, when the unit's preflight left them to it (`--defer-probes`).

Cold, the probes (service.gpu_probe: a Triton kernel, and the FLA kernels compiled, autotuned and run on the
target's shape) take about 26 s, and the rank's own start about 45 s more: imports, then the target's and the
drafter's compile, on the CPU. One after the other, a new CT's first start took 71-77 s to its first step
(docs/journal.md, sessions 21-23). So the rank runs them beside its start: local rank 0 of each node starts
them in child processes (preflight's own, with its timeouts) as soon as its configuration has loaded, and
keeps each passed verdict (service.probe_cache), as preflight would have. Every rank holds its first FLA
kernel launch (model.kernels.hold_first_launch), and its first step's end, until every probe has passed: its
FLA kernels find the probes' autotune results on disk instead of autotuning beside them on the same GPU, and a
failed probe stops the rank with preflight's own line and fix. A rank that fails for another reason names a
probe that failed as well (`after_failure`): a broken Triton fails the rank's compile first, less plainly.
The other local ranks wait for the verdicts to appear in the verdict file; a failed probe ends local rank 0,
and the launcher ends the job.

A one-process run does not sit idle meanwhile: it compiles its drafter's step before the target's first
kernel launch (train.loop, `running`), and the two processes' kernel timings take turns on the GPU
(service.timing_turns).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

from dflash_trainer.service import preflight, probe_cache

log = logging.getLogger("dflash_trainer.service")

POLL_S = 0.5  # how often a rank that does not probe reads the verdict file


class ProbeFailed(RuntimeError):
    """A probe beside the start failed: the message is preflight's line for it, fix included."""


def failure_line(failed: preflight.Failed) -> str:
    """A probe's failure as preflight prints it: `FAIL triton: DETAIL -- fix: FIX`."""
    return preflight.format_line(preflight.Check("triton", False, failed.detail, failed.fix))


class ProbesBeside:
    """The plan's missing probes, run on a thread of this rank (`runs`) or awaited in the verdict file."""

    def __init__(self, plan: preflight.ProbePlan, *, runs: bool, timeout_s: float | None = None) -> None:
        self.plan = plan
        # The probes run at once, each under its own timeout; a waiting rank allows the longest and a margin.
        self.timeout_s = timeout_s or max(t for _cmd, t in plan.commands.values()) + 60
        self.started = time.monotonic()
        self.done = threading.Event()
        self.failure: preflight.Failed | None = None
        self.line = ""
        self.took_s = 0.0  # from their start to their verdict
        self.waited_s = 0.0  # this rank's wait for it
        self._reported = False
        thread = threading.Thread(
            target=self._probe if runs else self._await, name="probes-beside", daemon=True
        )
        thread.start()

    def _probe(self) -> None:
        try:
            self.line = preflight.run_probes(self.plan)
        except preflight.Failed as e:
            self.failure = e
        except Exception as e:  # the runner itself broke: still a verdict, never a hang
            self.failure = preflight.Failed(f"{type(e).__name__}: {e}", "report this probe crash")
        finally:
            self._finish()

    def _finish(self) -> None:
        self.took_s = time.monotonic() - self.started
        self.done.set()

    def _await(self) -> None:
        path = self.plan.cache.path
        while True:
            cache = probe_cache.VerdictCache(path)
            kept = {name: cache.lookup(name, self.plan.keys[name]).verdict for name in self.plan.missing}
            if all(kept.values()):
                self.line = "; ".join(str(v) for v in kept.values()) + " [kept by local rank 0's probes]"
                break
            if time.monotonic() - self.started > self.timeout_s:
                self.failure = preflight.Failed(
                    f"no verdict of the {' and '.join(self.plan.missing)} probe(s) appeared in {path} in "
                    f"{self.timeout_s:.0f} s",
                    "local rank 0 runs them beside its start: its log lines say what they found",
                )
                break
            time.sleep(POLL_S)
        self._finish()

    def running(self) -> bool:
        """No verdict yet: the rank's first FLA kernel launch would wait for one."""
        return not self.done.is_set()

    def wait(self, before: str) -> None:
        """Returns once every probe passed (said once, with its time); raises ProbeFailed otherwise."""
        if not self.done.is_set():
            log.info(
                "%s waits for the GPU probes beside the start (%s, running for %.1f s)",
                before, " and ".join(self.plan.missing), time.monotonic() - self.started,
            )  # fmt: skip
            waiting = time.monotonic()
            self.done.wait()
            self.waited_s += time.monotonic() - waiting
        if self.failure is not None:
            raise ProbeFailed(failure_line(self.failure))
        if not self._reported:
            self._reported = True
            log.info(
                "GPU probes beside the start passed in %.1f s (this rank waited %.1f s for them): %s",
                self.took_s, self.waited_s, self.line,
            )  # fmt: skip

    def after_failure(self, wait_s: float = 30.0) -> str | None:
        """A failed probe's line, for a rank that failed (waits up to `wait_s` for one still running)."""
        self.done.wait(wait_s)
        return failure_line(self.failure) if self.failure is not None else None


def start(cfg, device: str) -> ProbesBeside | None:
    """The probes this rank's start still needs, started (local rank 0) or awaited; None when none is missing
    (preflight probed, or their verdicts are kept) or nothing runs on a GPU. Imports torch; before the model's
    imports, so that the probes run beside them."""
    if device != "cuda":
        return None
    target: Path = cfg.model.target_path
    plan = preflight.plan_probes(target if preflight.target_is_hybrid(target) else None, full=False)
    if not plan.missing:
        return None
    runs = os.environ.get("LOCAL_RANK", "0") == "0"
    log.info(
        "GPU probes beside the start: %s %s (%s)",
        " and ".join(plan.missing), "started" if runs else "awaited from local rank 0", "; ".join(plan.notes),
    )  # fmt: skip
    return ProbesBeside(plan, runs=runs)
