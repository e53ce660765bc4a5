"""Checks INVENTORY before a play: it exists, parses and has the groups the plays target."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

GROUPS = ("proxmox_hosts", "training_cts")


def check(inventory: Path) -> list[str]:
    if not inventory.exists():
        return [f"INVENTORY={inventory}: no such file or directory (try inventory/lab or inventory/example)"]
    tool = str(Path(sys.executable).parent / "ansible-inventory")
    proc = subprocess.run([tool, "-i", str(inventory), "--list"], capture_output=True, text=True, check=False)
    noise = [line for line in proc.stderr.splitlines() if "Unable to parse" in line or "ERROR" in line]
    if proc.returncode != 0 or noise:
        detail = (noise or proc.stderr.strip().splitlines() or ["no output"])[-1]
        return [f"INVENTORY={inventory}: cannot be parsed: {detail.strip()}"]
    data = json.loads(proc.stdout)
    return [
        f"INVENTORY={inventory}: group {g} has no hosts" for g in GROUPS if not data.get(g, {}).get("hosts")
    ]


if __name__ == "__main__":
    problems = check(Path(sys.argv[1]))
    for line in problems:
        print(line, file=sys.stderr)
    sys.exit(1 if problems else 0)
