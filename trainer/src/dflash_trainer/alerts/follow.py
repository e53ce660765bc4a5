"""`python -m dflash_trainer.alerts follow`: dflash-alert-watch.service, beside the trainer, never inside it.

Follows the trainer's journal (journalctl -f -o json), keeps the run's figures (figures.py), and every
`every_s` seconds spools the stall/slowdown/stale-checkpoint events that just began (watch.py) and rewrites
the metrics textfile (metrics.py). The trainer is not touched: a crash here costs figures, never a step.
"""

from __future__ import annotations

import json
import logging
import os
import select
import subprocess
import time
from pathlib import Path

from dflash_trainer.alerts import metrics, spool
from dflash_trainer.alerts.figures import Figures
from dflash_trainer.alerts.run_state import train_settings
from dflash_trainer.alerts.settings import Settings
from dflash_trainer.alerts.watch import Alerting, Thresholds, check

log = logging.getLogger("dflash_trainer.alerts")
TEXTFILE = "dflash_train.prom"


def unit_state(unit: str) -> tuple[bool, int | None]:
    out = subprocess.run(
        ["systemctl", "show", "-p", "ActiveState", "-p", "SubState", "-p", "NRestarts", unit],
        capture_output=True, text=True, check=False,
    ).stdout  # fmt: skip
    props = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    # "activating (start-post)" is after READY=1; before it nothing trains yet.
    active = props.get("ActiveState") == "active" or props.get("SubState") == "start-post"
    restarts = props.get("NRestarts", "")
    return active, int(restarts) if restarts.isdigit() else None


def tick(f: Figures, settings: Settings, alerting: Alerting, now: float) -> None:
    train = train_settings(settings.train_config)
    ckpt, on_disk = train.checkpoints()
    active, restarts = unit_state(settings.unit)
    thresholds = Thresholds(
        settings.slow_share,
        settings.slow_minutes,
        settings.checkpoint_intervals,
        train.checkpoint_every,
        train.keep_last,
    )
    for event, what in check(f, thresholds, now, active=active, checkpoint_at=ckpt.mtime if ckpt else None,
                             alerting=alerting, checkpoints_on_disk=on_disk):  # fmt: skip
        log.warning("%s: %s", event, what)
        spool.put(settings.spool_dir, {"hook": "watch", "unit": settings.unit, "event": event, "what": what,
                                       "step": f.step})  # fmt: skip
    if settings.textfile_dir:
        text = metrics.render(
            f, unit=settings.unit, active=active, restarts=restarts, max_steps=train.max_steps,
            checkpoint_step=ckpt.step if ckpt else None, checkpoint_age_s=ckpt.age_s(now) if ckpt else None,
            checkpoints_on_disk=on_disk,
        )  # fmt: skip
        metrics.write_textfile(Path(settings.textfile_dir), TEXTFILE, text)


def follow(settings: Settings, *, every_s: float = 15.0, backlog: int = 5000) -> None:
    f, alerting = Figures(), Alerting()
    cmd = ["journalctl", "-u", settings.unit, "-f", "-o", "json", "--no-pager", "-n", str(backlog)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE)
    assert proc.stdout is not None
    fd, pending, due = proc.stdout.fileno(), b"", time.monotonic()
    try:
        while proc.poll() is None:
            ready, _, _ = select.select([fd], [], [], max(0.0, due - time.monotonic()))
            if ready:  # raw reads: a buffered reader could hold lines back from select
                chunk = os.read(fd, 1 << 16)
                *lines, pending = (pending + chunk).split(b"\n")
                for raw in lines:
                    feed(f, raw)
            if time.monotonic() >= due:
                due = time.monotonic() + every_s
                try:
                    tick(f, settings, alerting, time.time())
                except OSError as e:  # a full disk, a missing directory: say so, keep following
                    log.error("watch: %s", e)
    finally:
        proc.kill()


def feed(f: Figures, raw: bytes) -> None:
    try:
        e = json.loads(raw)
    except ValueError:
        return
    message = e.get("MESSAGE")
    if isinstance(message, str):
        at = int(e.get("__REALTIME_TIMESTAMP", time.time() * 1e6)) / 1e6
        f.feed(message, at, e.get("_SYSTEMD_INVOCATION_ID", ""))
