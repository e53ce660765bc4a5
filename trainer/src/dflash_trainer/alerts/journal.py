"""The journal of one invocation of a unit, through journalctl's JSON output (journalctl(1), -o json)."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence


def entries(unit: str, *, lines: int = 4000, journalctl: str = "journalctl") -> list[dict[str, str]]:
    """The unit's newest entries, oldest first: its processes' lines and systemd's lines about it."""
    proc = subprocess.run(
        [journalctl, "-u", unit, "-o", "json", "--no-pager", "-n", str(lines)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    out = []
    for raw in proc.stdout.splitlines():
        try:
            entry = json.loads(raw)
        except ValueError:
            continue
        message = entry.get("MESSAGE")
        if isinstance(message, list):  # journalctl writes a non-UTF-8 message as a byte array
            entry["MESSAGE"] = bytes(message).decode("utf-8", "replace")
        elif not isinstance(message, str):
            continue
        out.append(entry)
    return out


def invocation_lines(found: Sequence[dict[str, str]], invocation: str) -> list[str]:
    """The messages of one invocation: its processes carry _SYSTEMD_INVOCATION_ID, systemd's own lines
    about the unit INVOCATION_ID. Without an id: everything after the unit's last start."""
    if invocation:
        return [
            e["MESSAGE"]
            for e in found
            if invocation in (e.get("_SYSTEMD_INVOCATION_ID"), e.get("INVOCATION_ID"))
        ]
    start = 0
    for i, e in enumerate(found):
        if e.get("_PID") == "1" and e.get("MESSAGE", "").startswith("Starting "):
            start = i
    return [e["MESSAGE"] for e in found[start:]]
