# Copyright: the dflash project. GNU General Public License v3.0+
"""devN passthrough entries of a Proxmox CT: the plan the API path (pve_ct) and the pct path (pve_ct_pct)
share."""

from __future__ import annotations

import re

DEV_KEY = re.compile(r"^dev(\d+)$")


def plan_devices(current: dict, wanted: list[dict]) -> tuple[dict, list[str]]:
    """(devN -> value to set, devN to delete): every wanted path exactly once, existing indexes kept."""

    def value(dev: dict) -> str:
        opts = [f"{k}={dev[k]}" for k in ("gid", "mode", "uid") if dev.get(k) not in (None, "")]
        return ",".join([dev["path"], *opts])

    by_path: dict[str, str] = {}
    deletes: list[str] = []
    for key in sorted((k for k in current if DEV_KEY.match(k)), key=lambda k: int(k[3:])):
        path = str(current[key]).split(",")[0].removeprefix("path=")
        if path in by_path or path not in {d["path"] for d in wanted}:
            deletes.append(key)  # a duplicate or a device no longer wanted
        else:
            by_path[path] = key
    sets: dict[str, str] = {}
    used = {int(k[3:]) for k in by_path.values()}
    for dev in wanted:
        key = by_path.get(dev["path"])
        if key is None:
            index = next(i for i in range(256) if i not in used)
            used.add(index)
            key = f"dev{index}"
            if key in deletes:
                deletes.remove(key)
        if str(current.get(key)) != value(dev):
            sets[key] = value(dev)
    return sets, deletes
