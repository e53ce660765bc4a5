"""Checks INVENTORY before a play: it exists, parses, has the groups the plays target, and each training CT's
rank count agrees: [topology] of its train.toml, its ct_gpus and any trainer_service_nproc (the rule lives
with the role that renders the unit: roles/trainer_service/filter_plugins/dflash_train_config.py)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

GROUPS = ("proxmox_hosts", "training_cts")
REPO = Path(__file__).resolve().parents[1]


def rank_problems(data: dict) -> list[str]:
    path = REPO / "roles/trainer_service/filter_plugins/dflash_train_config.py"
    spec = importlib.util.spec_from_file_location("dflash_train_config", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    reference = (REPO / "trainer/configs/reference.toml").read_text()
    hostvars = data.get("_meta", {}).get("hostvars", {})
    hosts = data.get("training_cts", {}).get("hosts", [])
    return [p for h in hosts for p in module.host_problems(h, hostvars.get(h, {}), reference)]


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
    ] + [f"INVENTORY={inventory}: {p}" for p in rank_problems(data)]


if __name__ == "__main__":
    problems = check(Path(sys.argv[1]))
    for line in problems:
        print(line, file=sys.stderr)
    sys.exit(1 if problems else 0)
