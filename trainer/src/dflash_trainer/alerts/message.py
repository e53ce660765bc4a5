"""One alert message: who (host, CT, unit), what (event, cause), where the run is (step, checkpoint)."""

from __future__ import annotations

import socket
import time
from typing import Any

from dflash_trainer.alerts.classify import Cause
from dflash_trainer.alerts.run_state import Checkpoint, duration

# event -> (severity, headline)
EVENTS = {
    "failed": ("critical", "failed"),
    "gave_up": ("critical", "gave up"),
    "recovered": ("info", "recovered after a restart"),
    "finished": ("info", "finished"),
    "stopped": ("info", "stopped cleanly"),
    "stalled": ("warning", "stalled"),
    "slow": ("warning", "slowed down"),
    "no_checkpoint": ("warning", "no recent checkpoint"),
    "old_checkpoints": ("warning", "old checkpoints not removed"),
    "test": ("info", "test message"),
}


def build(
    event: str,
    *,
    unit: str,
    host: str,
    ct: str,
    cause: Cause | None,
    step: int | None,
    max_steps: int | None,
    checkpoint: Checkpoint | None,
    restarts: int | None,
    note: str = "",
    now: float | None = None,
) -> dict[str, Any]:
    now = time.time() if now is None else now
    severity, headline = EVENTS[event]
    node = socket.gethostname()
    where = f"{ct or node} on {host}" if host else (ct or node)
    title = f"dflash-train {headline} on {where}"
    if cause is not None and event in ("failed", "gave_up"):
        title += f": {cause.title}"
    lines = [cause.summary if cause is not None else note or headline]
    if note and cause is not None:
        lines.append(note)
    progress = f"step {step if step is not None else '?'}"
    if max_steps:
        progress += f" of {max_steps}"
    if checkpoint is not None:
        progress += f"; last checkpoint step {checkpoint.step}, {duration(checkpoint.age_s(now))} ago"
    else:
        progress += "; no checkpoint yet"
    if restarts:
        progress += f"; {restarts} restart(s)"
    lines.append(progress)
    lines.append(f"unit {unit} in {node}" + (f" (CT {ct}, host {host})" if ct or host else ""))
    return {
        "event": event,
        "severity": severity,
        "title": title,
        "text": title + "\n" + "\n".join(lines),
        "host": host,
        "ct": ct,
        "node": node,
        "unit": unit,
        "time": int(now),
        "step": step,
        "max_steps": max_steps,
        "restarts": restarts,
        "checkpoint": None
        if checkpoint is None
        else {"step": checkpoint.step, "path": str(checkpoint.path), "age_s": round(checkpoint.age_s(now))},
        "cause": None
        if cause is None
        else {
            "kind": cause.kind,
            "summary": cause.summary,
            "rank": cause.rank,
            "gpu": cause.gpu,
            "role": cause.role,
            "check": cause.check,
            "exit_status": cause.exit_status,
        },
    }
