"""The drain: each spooled event becomes at most one message (run by dflash-alert.service as root).

failure hook (ExecStopPost=, result not success) -> "failed" with the cause read from the journal;
stop hook, result success                        -> "finished" or "stopped cleanly", from the journal;
start hook (ExecStartPost=, after READY=1)       -> "recovered" when the previous event was a failure;
OnFailure= unit, result start-limit-hit          -> "gave up". An OnFailure= run for a failure that the stop
hook reported already (systemd versions differ on whether OnFailure= fires between restarts) is not sent
again.
"""

from __future__ import annotations

import json
import logging
import subprocess
import time
from collections.abc import Callable
from typing import Any

from dflash_trainer.alerts import journal, message, spool
from dflash_trainer.alerts.classify import Cause, classify, last_step
from dflash_trainer.alerts.run_state import train_settings
from dflash_trainer.alerts.settings import Settings
from dflash_trainer.alerts.state import State
from dflash_trainer.alerts.watch import WATCH_EVENTS

log = logging.getLogger("dflash_trainer.alerts")
Send = Callable[[dict[str, Any]], bool]
JOURNAL_SETTLE_S = 3.0  # journald may file a rank's last lines after systemd ran the stop hook


def unit_property(unit: str, prop: str) -> str:
    proc = subprocess.run(
        ["systemctl", "show", "-p", prop, "--value", unit], capture_output=True, text=True, check=False
    )
    return proc.stdout.strip()


def _lines(unit: str, invocation: str, result: str, read: Callable[[str], list[dict[str, str]]]) -> list[str]:
    """The invocation's lines, once the line that ends the story is there (or JOURNAL_SETTLE_S passed)."""
    deadline = time.monotonic() + JOURNAL_SETTLE_S
    while True:
        lines = journal.invocation_lines(read(unit), invocation)
        done = any(
            ("launcher: " in ln and ("error: " in ln or "cleanly" in ln))
            or ln.startswith(("FAIL ", "preflight "))
            for ln in lines
        )
        if done or result in ("watchdog", "oom-kill", "start-limit-hit") or time.monotonic() > deadline:
            return lines
        time.sleep(0.3)


def decide(event: dict[str, Any], st: State, cause: Cause | None) -> str | None:
    """Which message an event makes, if any (pure, given the state)."""
    hook, result = event["hook"], event.get("result", "")
    last = st.data.get("last_event")
    if hook == "watch":
        return event.get("event") if event.get("event") in WATCH_EVENTS else None
    if hook == "start":
        return "recovered" if last in ("failed", "gave_up") else None
    if hook == "failure":
        gave_up = result == "start-limit-hit" or event.get("active_state", "failed") == "failed"
        return "gave_up" if gave_up else "failed"
    if result == "success":
        return cause.kind if cause is not None and cause.kind in ("finished", "stopped") else "stopped"
    return "failed"


def handle(
    event: dict[str, Any],
    settings: Settings,
    st: State,
    send: Send,
    read: Callable[[str], list[dict[str, str]]] | None = None,
    prop: Callable[[str, str], str] | None = None,
) -> dict[str, Any] | None:
    read = read or journal.entries
    prop = prop or unit_property
    unit, invocation, result = event["unit"], event.get("invocation", ""), event.get("result", "")
    if event["hook"] == "watch":  # follow.py: WATCH_EVENTS (once per episode already)
        key = f"watch:{event.get('event')}:{event.get('time')}"
    elif event["hook"] == "start":
        key = f"start:{invocation}"
    elif event["hook"] == "failure" and decide(event, st, None) == "gave_up":
        key = f"gave_up:{invocation}"
    else:
        key = f"stop:{invocation}"  # an OnFailure= between restarts: the stop hook's failure again
    if st.seen(key):
        return None
    cause: Cause | None = None
    lines: list[str] = []
    if event["hook"] in ("stop", "failure"):
        lines = _lines(unit, invocation, result, read)
        code, status = event.get("exit_code", ""), event.get("exit_status", "")
        cause = classify(lines, result, exit_code=code, exit_status=status)
    kind = decide(event, st, cause)
    if kind == "gave_up" and cause is not None and cause.kind != "start_limit":
        burst = prop(unit, "StartLimitBurst")
        interval = prop(unit, "StartLimitIntervalUSec")
        cause = Cause(
            "start_limit",
            f"failed {burst} times within {interval}; the last failure: {cause.summary}",
            rank=cause.rank,
            gpu=cause.gpu,
            role=cause.role,
            check=cause.check,
            exit_status=cause.exit_status,
            detail=cause.detail,
        )
    if kind is None:
        if event["hook"] == "start":
            st.data["last_event"] = "started"
        return None
    train = train_settings(settings.train_config)
    checkpoint = train.newest_checkpoint()
    restarts = prop(unit, "NRestarts")
    note = ""
    if kind == "failed":
        burst = prop(unit, "StartLimitBurst")
        note = f"systemd restarts it and it resumes from its newest checkpoint (start limit {burst})"
    elif kind == "gave_up":
        note = f"it stays failed: `systemctl reset-failed {unit}; systemctl start {unit}` once fixed"
    elif kind == "recovered":
        previous = st.data.get("last_failure") or {}
        note = "training again after: " + previous.get("summary", "a failure")
    step = last_step(lines) if lines else event.get("step", st.data.get("last_step"))
    if event["hook"] == "watch":
        note = event.get("what", "")
    if kind == "recovered" and checkpoint is not None:
        step = checkpoint.step  # where the new start resumed
    msg = message.build(
        kind,
        unit=unit,
        host=settings.host,
        ct=settings.ct,
        cause=cause,
        step=step,
        max_steps=train.max_steps,
        checkpoint=checkpoint,
        restarts=int(restarts) if restarts.isdigit() else None,
        note=note,
    )
    st.mark(key)
    if event["hook"] != "watch":  # a warning does not change what "recovered" follows
        st.data["last_event"] = kind
    if msg["step"] is not None:
        st.data["last_step"] = msg["step"]
    if kind in ("failed", "gave_up") and cause is not None:
        st.data["last_failure"] = {"time": msg["time"], "kind": cause.kind, "summary": cause.summary}
    st.data["last_message"] = {"time": msg["time"], "event": kind, "title": msg["title"]}
    st.save()  # before the post: a slow endpoint never loses what happened
    msg["delivered"] = send(msg)
    return msg


def drain(settings: Settings, send: Send) -> int:
    """Every pending event, oldest first; each file is removed once handled (or unreadable)."""
    count = 0
    st = State(settings.state_dir)
    while files := spool.pending(settings.spool_dir):
        for path in files:
            try:
                event = json.loads(path.read_text())
            except (OSError, ValueError) as e:
                log.warning("alert event %s unreadable (%s); dropped", path.name, e)
                path.unlink(missing_ok=True)
                continue
            path.unlink(missing_ok=True)
            try:
                msg = handle(event, settings, st, send)
            except Exception as e:  # one bad event must not block the ones behind it
                log.error("alert event %s: %s: %s", path.name, type(e).__name__, e)
                continue
            if msg is not None:
                count += 1
                log.info("%s (%s)", msg["title"], "delivered" if msg["delivered"] else "NOT delivered")
    st.save()
    return count
