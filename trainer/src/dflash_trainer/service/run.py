"""`dflash-train serve CONFIG`: one rank of the training job as systemd sees it.

Builds the run through train/loop.py's public API (`train(cfg, hooks=..., stop=...)`), and wires:
READY=1 once the target, drafter, data and the newest checkpoint are loaded; STATUS= (step, loss, tokens/s)
and WATCHDOG=1 from the loop's own per-step hook, so a hung step or collective misses the ping; trackers
behind SafeTracker; SIGTERM -> the loop saves a checkpoint at the end of the current step -> exit 0.
Every start resumes from the newest checkpoint in train.checkpoint_dir (the loop does it).
A topology of more than one rank runs this rank's pipeline role instead, with the same behaviour
(service/pipeline.py); the first drafter rank is then the one that speaks to systemd.
"""

from __future__ import annotations

import argparse
import faulthandler
import inspect
import json
import logging
import os
import resource
import signal
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from dflash_trainer.service.logs import rank, setup_logging
from dflash_trainer.service.notify import Notifier

log = logging.getLogger("dflash_trainer.service")


class ServiceHooks:
    """The per-step hook: watchdog, STATUS, trackers, smoke bookkeeping, the smoke's pause point."""

    def __init__(
        self, cfg, notifier: Notifier, stop: threading.Event, trackers, *, pause_at: int | None
    ) -> None:
        self.cfg, self.notifier, self.stop, self.trackers = cfg, notifier, stop, trackers
        self.pause_at = pause_at
        self.ready = False
        self.started = time.time()
        self.first_step_at: float | None = None
        self.first_step: int | None = None
        self.steps = 0
        self.tokens = 0
        self.busy_s = 0.0
        self.last = None

    def on_ready(self, *_: object) -> None:
        if self.ready:
            return
        self.ready = True
        self.notifier.ready(status="loaded; training")
        self.notifier.watchdog(force=True)
        log.info("ready: models and data loaded in %.1f s", time.time() - self.started)

    def __call__(self, m) -> None:
        if not self.ready:  # the loop has no ready hook: the first finished step proves everything loaded
            self.on_ready()
        if self.first_step_at is None:
            self.first_step_at, self.first_step = time.time(), m.step
        else:  # the first step carries warm-up (compilation, allocator); the rate leaves it out
            self.steps += 1
            self.tokens += m.seq_tokens
            self.busy_s += m.seq_tokens / m.tokens_per_s if m.tokens_per_s else 0.0
        self.last = m
        self.notifier.watchdog()
        if self.notifier.watchdog_s:
            # A hung step dumps every thread's stack into the journal just before systemd's watchdog fires.
            faulthandler.dump_traceback_later(self.notifier.watchdog_s * 0.8, exit=False)
        every = self.cfg.service.status_every
        if m.step % every == 0 or m.step == self.first_step:
            self.notifier.status(f"step {m.step} loss {m.loss:.4f} {m.tokens_per_s:.0f} tok/s lr {m.lr:.2e}")
        if self.trackers and (m.step % self.cfg.train.log_every == 0 or m.eval):
            values = {
                "train/loss": m.loss,
                "train/lr": m.lr,
                "train/grad_norm": m.grad_norm,
                "train/acceptance_length": m.acceptance_length,
                "train/tokens_per_s": m.tokens_per_s,
            } | {f"eval/{k}": v for k, v in (m.eval or {}).items()}
            for tracker in self.trackers:
                tracker.log(m.step, values)
        if self.pause_at is not None and m.step == self.pause_at:
            self.notifier.status(f"step {m.step}: paused for the smoke run's stop")
            log.info("paused at step %d until stopped (smoke run)", m.step)
            while not self.stop.wait(max(0.2, (self.notifier.watchdog_s or 2.0) / 4)):
                self.notifier.watchdog(force=True)

    def summary(self) -> dict:
        if self.cfg.train.device != "cpu":
            try:
                import torch

                if torch.cuda.is_available():
                    peak = {
                        f"cuda:{i}": torch.cuda.max_memory_allocated(i)
                        for i in range(torch.cuda.device_count())
                    }
                else:
                    peak = {}
            except Exception:
                peak = {}
        else:
            peak = {}
        if not peak:
            peak = {"cpu (max RSS)": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
        return {
            "rank": rank(),
            "role": os.environ.get("DFLASH_ROLE", "trainer"),
            "started": self.started,
            "first_step_at": self.first_step_at,
            "first_step": self.first_step,
            "last_step": self.last.step if self.last else None,
            "last_loss": self.last.loss if self.last else None,
            "tokens_per_s": self.tokens / self.busy_s if self.busy_s else None,
            "peak_memory_bytes": peak,
            "trackers_failed": {t.name: t.failed for t in self.trackers if t.failed},
        }


def _ready_kwargs(train_fn, hooks: ServiceHooks) -> dict:
    """READY right after load when the loop offers a ready callback; else at the first step (see __call__)."""
    params = inspect.signature(train_fn).parameters
    return {"on_ready": hooks.on_ready} if "on_ready" in params else {}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dflash-train serve", description=__doc__.splitlines()[0])
    parser.add_argument("config", type=Path)
    parser.add_argument("--max-steps", type=int, default=None, help="stop (and save) at this step")
    parser.add_argument("--pause-at", type=int, default=None, help="smoke: wait at this step until SIGTERM")
    parser.add_argument("--summary", type=Path, default=None, help="write DIR/summary-rank<R>.json at exit")
    args = parser.parse_args(argv)

    setup_logging()
    stop = threading.Event()
    hooks_box: list[ServiceHooks] = []
    voice = [Notifier({})]  # this rank's notifier, once the configuration says which rank speaks

    def on_signal(signum: int, _frame: object) -> None:
        name = signal.Signals(signum).name
        if hooks_box and hooks_box[0].ready:
            if not stop.is_set():
                log.info("%s: saving a checkpoint after this step, then exiting", name)
                voice[0].stopping(status=f"{name}: saving a checkpoint")
            stop.set()
        else:  # nothing trained yet, nothing to save: leave at once instead of finishing a minute of loading
            log.info("%s before the first step: nothing to save, exiting", name)
            voice[0].stopping()
            os._exit(0)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    from dflash_trainer.config import ConfigError, load_config
    from dflash_trainer.service.pipeline import (
        leader_rank,
        named_ranks,
        serve_pipeline,
        wants_pipeline,
        world_size,
    )

    try:
        cfg = load_config(args.config)
        pipeline = wants_pipeline(cfg.topology, world_size())
        speaker = leader_rank(cfg, world_size())
    except (ConfigError, ValueError) as e:
        log.error("configuration: %s", e)
        return 1
    if not pipeline and named_ranks(cfg.topology) > 1:
        log.warning(
            "[topology] names %d ranks but 1 was launched: running the single-process loop "
            "(launch --nproc-per-node %d for the pipeline)",
            named_ranks(cfg.topology),
            named_ranks(cfg.topology),
        )
    # One rank speaks to systemd: rank 0 of a single-process run; of a pipeline the first drafter, which
    # waits on every other rank each step (receives, DDP): a hang anywhere stops its WATCHDOG=1.
    notifier = voice[0] = Notifier() if rank() == speaker else Notifier({})

    from dflash_trainer.service.trackers import start_trackers
    from dflash_trainer.train.loop import train

    trackers = start_trackers(cfg) if rank() == speaker else []
    hooks = ServiceHooks(cfg, notifier, stop, trackers, pause_at=args.pause_at)
    hooks_box.append(hooks)
    notifier.status("loading target, drafter, data and the newest checkpoint")
    code = 0
    try:
        if pipeline:
            serve_pipeline(args.config, cfg, hooks, stop, max_steps=args.max_steps)
            step = hooks.last.step if hooks.last else None
            how = "stopped" if stop.is_set() else "finished"
            log.info("%s%s", how, f" at step {step}" if step is not None else "")
        else:
            kwargs = _ready_kwargs(train, hooks)
            result = train(cfg, max_steps=args.max_steps, hooks=[hooks], stop=stop, **kwargs)
            how, step = ("stopped" if result.stopped else "finished"), result.step
            where = result.checkpoint or "no checkpoint (nothing trained)"
            log.info("%s at step %d; checkpoint %s", how, result.step, where)
        faulthandler.cancel_dump_traceback_later()
        notifier.stopping(status=f"{how} at step {step}")
    except Exception as e:
        faulthandler.cancel_dump_traceback_later()
        log.critical("training failed: %s: %s", type(e).__name__, e, exc_info=True)
        notifier.status(f"failed: {type(e).__name__}: {e}"[:200])
        code = 1
    finally:
        for tracker in trackers:
            tracker.close()
        if args.summary is not None:
            args.summary.mkdir(parents=True, exist_ok=True)
            out = args.summary / f"summary-rank{rank()}.json"
            out.write_text(json.dumps(hooks.summary() | {"exit_code": code}, indent=1) + "\n")
    sys.stdout.flush()
    return code
