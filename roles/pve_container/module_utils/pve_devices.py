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
    used = {int(k[3:]) for k in by_path.values()}
    sets = _place(
        "dev", current, wanted, by_path, deletes, used, value, lambda old, dev: str(old) == value(dev)
    )
    return sets, deletes


def _place(prefix, current, wanted, by_path, deletes, used, value, same) -> dict[str, str]:
    """The entries to set: each wanted one at the key its path already has, else at the first free index
    (taken back from the deletes when it was one), set where the current value is not the same."""
    sets: dict[str, str] = {}
    for entry in wanted:
        key = by_path.get(entry["path"])
        if key is None:
            index = next(i for i in range(256) if i not in used)
            used.add(index)
            key = f"{prefix}{index}"
            if key in deletes:
                deletes.remove(key)
        if key not in current or not same(current[key], entry):
            sets[key] = value(entry)
    return sets


MP_KEY = re.compile(r"^mp(\d+)$")


def entry_order(key: str) -> tuple[str, int]:
    """devN and mpN keys in pct's own order: dev0, dev1, ..., mp0, mp1, ..."""
    prefix = key.rstrip("0123456789")
    return prefix, int(key[len(prefix) :])


def repeated(values: list[str]) -> list[str]:
    return sorted({v for v in values if values.count(v) > 1})


def _mount(value: str) -> tuple[str, dict[str, str]]:
    """(volume, options) of an mpN value: "/mnt/pve/x,mp=/mnt/x,ro=1" (PVE prints the options in its own
    order, fakepve sorts them: compared as a dict, never as text)."""
    first, *rest = str(value).split(",")
    options = dict(part.partition("=")[::2] for part in rest if part)
    if first.startswith("volume="):
        first = first.removeprefix("volume=")
    return first, options


def mount_value(mount: dict) -> str:
    """The mpN value of a bind mount: HOST_PATH,mp=PATH[,ro=1]."""
    value = f"{mount['host_path']},mp={mount['path']}"
    return value + (",ro=1" if mount.get("read_only") else "")


def plan_mount_points(current: dict, wanted: list[dict]) -> tuple[dict, list[str]]:
    """(mpN -> value to set, mpN to delete) for the bind mounts (a host path mounted at a CT path): each
    wanted CT path exactly once, existing indexes kept. Storage volumes (local-lvm:vm-200-disk-1) hold data
    and are never touched; a bind mount at a CT path not wanted is removed (the host's data stays)."""
    by_path: dict[str, str] = {}
    deletes: list[str] = []
    taken: set[int] = set()
    wanted_paths = {m["path"] for m in wanted}
    for key in sorted((k for k in current if MP_KEY.match(k)), key=lambda k: int(k[2:])):
        volume, options = _mount(current[key])
        if not volume.startswith("/") or volume.startswith("/dev/"):
            taken.add(int(key[2:]))  # a storage volume or a device: not ours
            continue
        path = options.get("mp", "")
        if path in by_path or path not in wanted_paths:
            deletes.append(key)
        else:
            by_path[path] = key
    used = taken | {int(k[2:]) for k in by_path.values()}
    sets = _place(
        "mp",
        current,
        wanted,
        by_path,
        deletes,
        used,
        mount_value,
        lambda old, mount: _mount(old) == _mount(mount_value(mount)),
    )
    return sets, deletes
