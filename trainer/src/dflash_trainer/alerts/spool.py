"""Events from the unit's hooks: one small JSON file each in the spool directory, written and renamed.

A hook does nothing else (no journal, no network), so ExecStopPost= returns in milliseconds and a restart is
never held back; the path unit (DirectoryNotEmpty=) starts the drain."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any


def put(spool: Path, event: dict[str, Any]) -> Path:
    spool.mkdir(mode=0o700, parents=True, exist_ok=True)
    name = f"{time.time_ns():020d}-{os.getpid()}-{event['hook']}.json"
    tmp = spool / f".{name}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(event | {"time": time.time()}, f)
    final = spool / name
    os.replace(tmp, final)
    return final


def pending(spool: Path) -> list[Path]:
    try:
        return sorted(p for p in spool.iterdir() if p.suffix == ".json" and not p.name.startswith("."))
    except FileNotFoundError:
        return []


def hook_event(hook: str, env: dict[str, str], unit: str) -> dict[str, Any]:
    """What systemd tells a hook (systemd.exec(5), "Environment Variables Set or Propagated by the Service
    Manager"): $SERVICE_RESULT/$EXIT_CODE/$EXIT_STATUS in ExecStopPost=, $MONITOR_* in an OnFailure= unit."""
    if hook == "failure":
        # systemd 252 starts OnFailure= units only once Restart= gave up (the start limit), with the last
        # failure's result ("exit-code", not "start-limit-hit"); newer ones may start them between restarts.
        # The unit's state now tells which: "failed", or "activating"/"auto-restart".
        return {
            "hook": hook,
            "unit": env.get("MONITOR_UNIT") or unit,
            "invocation": env.get("MONITOR_INVOCATION_ID", ""),
            "result": env.get("MONITOR_SERVICE_RESULT", ""),
            "exit_code": env.get("MONITOR_EXIT_CODE", ""),
            "exit_status": env.get("MONITOR_EXIT_STATUS", ""),
            "active_state": env.get("DFLASH_ALERT_ACTIVE_STATE", ""),
        }
    return {
        "hook": hook,
        "unit": unit,
        "invocation": env.get("INVOCATION_ID", ""),
        "result": env.get("SERVICE_RESULT", ""),
        "exit_code": env.get("EXIT_CODE", ""),
        "exit_status": env.get("EXIT_STATUS", ""),
    }
