"""`dflash-train serve CONFIG`: one rank of the training job as systemd sees it.

The configuration is loaded and validated once, here, and the object handed to the run: this rank's role of
the pipeline (distributed/rank.py `run_rank`, the sides in train/target_side.py and train/drafter_side.py)
when the launcher started more than one rank, else the 1:1 pipeline in this one process (train/loop.py
`train`). The same run either way: READY=1 once every rank has loaded the target, drafter, data and the newest
checkpoint; STATUS= (step, loss, tokens/s) and WATCHDOG=1 from the drafter leader's per-step hook (it waits on
every target through its receives and on every drafter through DDP, so a hang anywhere stops the ping);
trackers behind SafeTracker on that rank only; SIGTERM on any rank -> the ranks agree on a stop step
(distributed/stopping.py), the leader saves, every rank exits 0. Every start resumes from the newest
checkpoint in train.checkpoint_dir. `--pause-at` (the smoke run's and the rehearsal's) wraps the step hook in
service/pause.py's PauseAt; without it the hook has no pause."""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
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

from dflash_trainer import stack_sampler, startup
from dflash_trainer.logs import rank, setup_logging
from dflash_trainer.service import autotune_compile, compile_caches, timing_turns
from dflash_trainer.service.notify import Heartbeat, Notifier
from dflash_trainer.service.pause import PauseAt
from dflash_trainer.service.probes_beside import ProbesBeside
from dflash_trainer.service.process import die_with_launcher, process_started

log = logging.getLogger("dflash_trainer.service")


class ServiceHooks:
    """The per-step hook: watchdog, STATUS, trackers, the rank summary's bookkeeping."""

    def __init__(self, cfg, notifier: Notifier, trackers) -> None:
        self.cfg, self.notifier, self.trackers = cfg, notifier, trackers
        self.autotune = autotune_compile.AutotuneTally()  # the compiles started ahead in this process
        self.ready = False
        self.started = process_started()
        self.first_step_at: float | None = None
        self.caches_at_ready = compile_caches.snapshot()  # again at READY: the first step's compiles after it
        self.first_step: int | None = None
        self.steps = 0
        self.tokens = 0
        self.busy_s = 0.0
        self.last = None
        self.last_eval: tuple[int, dict[str, float]] | None = None  # (step, figures) of the last evaluation
        self._relayed: int | None = None
        self.profile: stack_sampler.StackSampler | None = None  # $DFLASH_PROFILE_START: start to first step
        self.probes: ProbesBeside | None = None  # the GPU probes preflight left to this start
        self.turns: timing_turns.Turns | None = None  # this rank's kernel timings, in turns with the probes'

    def on_ready(self, *_: object) -> None:
        if self.ready:
            return
        self.ready = True
        self.notifier.ready(status="loaded; training")
        self.notifier.watchdog(force=True)
        now = time.time()
        since = (
            f"{now - self.started:.1f} s after this rank's process started (interpreter, imports included)"
        )
        launched = os.environ.get("DFLASH_LAUNCH_T0")
        if launched:
            since += f", {now - float(launched):.1f} s after the launcher started"
        log.info("ready: target, drafter, data and the newest checkpoint loaded on every rank; %s", since)
        log.info("start: %s", startup.breakdown(now - self.started))  # where a warm restart's seconds went
        self.caches_at_ready = compile_caches.snapshot()
        if self.profile is not None:
            self.profile.mark("READY -> first step")

    def __call__(self, m) -> None:
        if not self.ready:  # the loop has no ready hook: the first finished step proves everything loaded
            self.on_ready()
        if self.first_step_at is None:
            if self.probes is not None:  # a rank that launched no FLA kernel has not waited for them yet
                self.probes.wait("the first step's end")
            self.first_step_at, self.first_step = time.time(), m.step
            autotune_kept = os.environ.get("TRITON_CACHE_AUTOTUNING") == "1"
            line = compile_caches.report(self.caches_at_ready, compile_caches.snapshot(), autotune_kept)
            if self.autotune.compiled_ahead:
                line += f"; {self.autotune.compiled_ahead} autotune candidates compiled ahead on threads"
            if self.turns is not None and self.turns.turns:
                line += f"; {self.turns.summary()}"
            log.info(line)
            if self.profile is not None:
                log.info(
                    "start profile: %s",
                    stack_sampler.write_report(self.profile, f"start-profile-rank{rank()}.txt"),
                )
                self.profile = None
        else:  # the first step carries warm-up (compilation, allocator); the rate leaves it out
            self.steps += 1
            self.tokens += m.seq_tokens
            self.busy_s += m.seq_tokens / m.tokens_per_s if m.tokens_per_s else 0.0
        self.last = m
        if m.eval:
            self.last_eval = (m.step, dict(m.eval))
        self.notifier.alive()  # a hung step dumps every thread's stack before systemd's watchdog fires
        every = self.cfg.service.status_every
        if m.step % every == 0 or m.step == self.first_step:
            status = f"step {m.step} loss {m.loss:.4f} {m.tokens_per_s:.0f} tok/s lr {m.lr:.2e}"
            if self.last_eval is not None and "walk_tau" in self.last_eval[1]:
                # The acceptance length serving would see, from the newest evaluation (decode walk).
                status += f" walk tau {self.last_eval[1]['walk_tau']:.2f} @ {self.last_eval[0]}"
            self.notifier.status(status)
        if self.trackers and (m.step % self.cfg.train.log_every == 0 or m.eval):
            values = {
                "train/loss": m.loss,
                "train/lr": m.lr,
                "train/grad_norm": m.grad_norm,
                "train/anchor_accept": m.anchor_accept,
                "train/tokens_per_s": m.tokens_per_s,
            } | {f"eval/{k}": v for k, v in (m.eval or {}).items()}
            for tracker in self.trackers:
                tracker.log(m.step, values)

    def relay(self, step: int) -> None:
        """Several nodes, a node speaker other than the leader: the leader beat (finished a step, or waits
        alive); this unit's watchdog and status follow it (a hang anywhere in the job stops every node's
        pings)."""
        if not self.ready:
            return
        self.notifier.watchdog(force=True)  # beats arrive at most once per relay interval
        if step != self._relayed and step % self.cfg.service.status_every == 0:
            self.notifier.status(f"step {step} (the job's leader reports loss and tokens/s)")
        self._relayed = step

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
            "autotune_compiled_ahead": self.autotune.compiled_ahead,  # the first step's and the walks'
            "eval_step": self.last_eval[0] if self.last_eval else None,
            "eval": self.last_eval[1] if self.last_eval else {},
        }


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def resolved_topology(cfg, world: int):
    """[topology] resolved for this world, once per rank (None for one process); the rank's run gets it."""
    if world < 2:
        return None
    from dflash_trainer.distributed.topology import resolve_topology

    return resolve_topology(world, cfg.topology.targets, cfg.topology.drafters)


def node_speaker(speaker: int) -> bool:
    """Several nodes: the leader speaks for its node's unit; every other node's unit hears from its local
    rank 0 (READY once the whole job loaded, WATCHDOG while the leader's steps move). One node: the leader."""
    if rank() == speaker:
        return True
    if int(os.environ.get("GROUP_WORLD_SIZE", "1")) < 2:
        return False
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # elastic numbers ranks node by node
    return os.environ.get("LOCAL_RANK") == "0" and rank() // per_node != speaker // per_node


def serve_pipeline(
    cfg, topo, hooks: ServiceHooks, stop: threading.Event, *, max_steps: int | None, pause: PauseAt | None
) -> Path | None:
    """This rank's role to the horizon or an agreed stop; raises on failure (the launcher ends the job).
    Returns the final checkpoint (the drafter leader's; None elsewhere, or when nothing was saved).
    `pause` (--pause-at) wraps the step hook and takes the relay (a stop asked on any node ends it)."""
    from dflash_trainer.distributed.rank import Control, RankOptions, run_rank

    options = RankOptions(
        resume=True, log_every=cfg.train.log_every, max_steps=max_steps, cpu=cfg.train.device == "cpu"
    )
    relay = hooks.relay if hooks.notifier.enabled and rank() != topo.drafter_ranks[0] else None
    control = Control(
        stop=stop,
        on_ready=hooks.on_ready,
        on_step=pause or hooks,
        on_progress=relay,
        progress=Heartbeat(hooks.notifier),
        on_relay=pause.attach_relay if pause is not None else None,
    )
    return run_rank(cfg, options, control, topo=topo)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dflash-train serve", description=__doc__.splitlines()[0])
    parser.add_argument("config", type=Path)
    parser.add_argument("--max-steps", type=int, default=None, help="stop (and save) at this step")
    parser.add_argument(
        "--pause-at", type=int, default=None, help="smoke run, rehearsal: wait at this step until stopped"
    )
    parser.add_argument("--summary", type=Path, default=None, help="write DIR/summary-rank<R>.json at exit")
    args = parser.parse_args(argv)

    die_with_launcher()
    setup_logging()
    profile = stack_sampler.from_environment(
        f"serve's start -> READY (the process started {time.time() - process_started():.1f} s before)"
    )
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
    from dflash_trainer.service import preflight, probes_beside

    try:
        cfg = load_config(args.config)  # once per rank; the run gets the object
        topo = resolved_topology(cfg, world_size())
        pipeline = topo is not None
        # The rank that speaks to systemd: the first drafter of a pipeline, else rank 0 (one process).
        speaker = topo.drafter_ranks[0] if topo is not None else 0
        compile_workers = autotune_compile.rank_workers()  # a bad DFLASH_COMPILE_WORKERS named before loading
    except (ConfigError, ValueError) as e:
        log.error("configuration: %s", e)
        return 1
    try:  # before the model's imports: the probes run beside them and the compile (probes_beside)
        probes = probes_beside.start(cfg, preflight.device_kind(cfg))
    except preflight.Failed as e:
        log.error("%s", probes_beside.failure_line(e))
        return 1
    if not pipeline and (cfg.topology.ranks or 1) > 1:
        log.info(
            "[topology] names %d ranks, 1 was launched: target and drafter in this one process (the 1:1 "
            "pipeline without the transport)",
            cfg.topology.ranks,
        )
    # One rank speaks to systemd: rank 0 of a single-process run; of a pipeline the first drafter, which
    # waits on every other rank each step (receives, DDP): a hang anywhere stops its WATCHDOG=1.
    notifier = voice[0] = Notifier() if node_speaker(speaker) else Notifier({})

    from dflash_trainer.model import kernels
    from dflash_trainer.service.trackers import start_trackers
    from dflash_trainer.train.loop import train

    if probes is not None:
        kernels.hold_first_launch(lambda: probes.wait("the first FLA kernel launch"))

    startup.record("interpreter, imports, configuration", time.time() - process_started())
    with startup.phase("trackers"):
        trackers = start_trackers(cfg) if rank() == speaker else []
    hooks = ServiceHooks(cfg, notifier, trackers)
    hooks.profile = profile
    hooks.probes = probes
    hooks_box.append(hooks)
    pause = PauseAt(hooks, args.pause_at, notifier, stop) if args.pause_at is not None else None
    notifier.status("loading target, drafter, data and the newest checkpoint")
    from dflash_trainer.checkpoint import CheckpointError

    code = 0
    try:
        turns = timing_turns.in_turns() if probes is not None else contextlib.nullcontext()
        with autotune_compile.for_this_rank(cfg.train.device, compile_workers, hooks.autotune), turns as t:
            hooks.turns = t
            if pipeline:
                checkpoint = serve_pipeline(cfg, topo, hooks, stop, max_steps=args.max_steps, pause=pause)
                step = hooks.last.step if hooks.last else None
                how = "stopped" if stop.is_set() else "finished"
                if step is not None:  # the drafter leader: the one that saved
                    log.info("%s at step %d; checkpoint %s", how, step, checkpoint or "no checkpoint")
                else:
                    log.info("%s", how)
            else:
                result = train(
                    cfg,
                    max_steps=args.max_steps,
                    hooks=[pause or hooks],
                    stop=stop,
                    on_ready=hooks.on_ready,
                    progress=Heartbeat(notifier),
                    compile_ahead=probes.running if probes is not None else None,
                )
                how, step = ("stopped" if result.stopped else "finished"), result.step
                where = result.checkpoint or "no checkpoint (nothing trained)"
                log.info("%s at step %d; checkpoint %s", how, result.step, where)
        faulthandler.cancel_dump_traceback_later()
        notifier.stopping(status=f"{how} at step {step}")
    except Exception as e:
        faulthandler.cancel_dump_traceback_later()
        probe = probes.after_failure() if probes is not None else None
        if probe is not None:  # the cause, however the rank's own failure (compile, launch) put it
            log.critical("training failed: a GPU probe beside the start failed: %s", probe)
            if not isinstance(e, probes_beside.ProbeFailed):
                own = (str(e).strip().splitlines() or [""])[-1]
                log.critical("the rank's own error: %s: %s", type(e).__name__, own)
        elif getattr(e, "__dflash_reported__", False):
            pass  # a pipeline rank's failure, logged once already (distributed/failure.py)
        elif isinstance(e, CheckpointError):  # names the checkpoint, its directory and the cause
            log.critical("training failed: %s", e)
        else:
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
