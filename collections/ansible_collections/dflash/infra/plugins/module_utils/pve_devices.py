# Copyright: the dflash project. GNU General Public License v3.0+
"""devN passthrough entries and bind mount points (mpN) of a Proxmox CT: the plan the API path (pve_ct) and
the pct path (pve_ct_pct) share."""

from __future__ import annotations

import re
from collections.abc import Callable


def entry_order(key: str) -> tuple[str, int]:
    """devN and mpN keys in pct's own order: dev0, dev1, ..., mp0, mp1, ..."""
    prefix = key.rstrip("0123456789")
    return prefix, int(key[len(prefix) :])


def _plan(
    prefix: str,
    current: dict,
    wanted: list[dict],
    owned_path: Callable[[str], str | None],
    value: Callable[[dict], str],
    same: Callable[[str, dict], bool],
) -> tuple[dict[str, str], list[str]]:
    """(key -> value to set, keys to delete) for the `prefix`N entries the role owns: each wanted path exactly
    once at the index it already has (else the first free one), a duplicate or an unwanted one deleted.
    `owned_path` gives an existing entry's path, or None for an entry the role never touches (its index stays
    taken)."""
    key_pattern = re.compile(rf"^{prefix}\d+$")
    wanted_paths = {entry["path"] for entry in wanted}
    by_path: dict[str, str] = {}
    deletes: list[str] = []
    used: set[int] = set()
    for key in sorted((k for k in current if key_pattern.match(k)), key=entry_order):
        path = owned_path(str(current[key]))
        if path is None:
            used.add(entry_order(key)[1])
        elif path in by_path or path not in wanted_paths:
            deletes.append(key)  # a duplicate, or no longer wanted
        else:
            by_path[path] = key
            used.add(entry_order(key)[1])
    sets: dict[str, str] = {}
    for entry in wanted:
        key = by_path.get(entry["path"])
        if key is None:
            index = next(i for i in range(256) if i not in used)
            used.add(index)
            key = f"{prefix}{index}"
            if key in deletes:  # an index freed above is taken back
                deletes.remove(key)
        if key not in current or not same(str(current[key]), entry):
            sets[key] = value(entry)
    return sets, deletes


def device_value(dev: dict) -> str:
    opts = [f"{k}={dev[k]}" for k in ("gid", "mode", "uid") if dev.get(k) not in (None, "")]
    return ",".join([dev["path"], *opts])


def plan_devices(current: dict, wanted: list[dict]) -> tuple[dict, list[str]]:
    """(devN -> value to set, devN to delete): every wanted path exactly once, existing indexes kept."""
    return _plan(
        "dev",
        current,
        wanted,
        lambda value: value.split(",")[0].removeprefix("path="),
        device_value,
        lambda old, dev: old == device_value(dev),
    )


def _mount(value: str) -> tuple[str, dict[str, str]]:
    """(volume, options) of an mpN value: "/mnt/pve/x,mp=/mnt/x,ro=1" (PVE prints the options in its own
    order, fakepve sorts them: compared as a dict, never as text)."""
    first, *rest = str(value).split(",")
    options = dict(part.partition("=")[::2] for part in rest if part)
    return first.removeprefix("volume="), options


def mount_value(mount: dict) -> str:
    """The mpN value of a bind mount: HOST_PATH,mp=PATH[,ro=1]."""
    value = f"{mount['host_path']},mp={mount['path']}"
    return value + (",ro=1" if mount.get("read_only") else "")


def _bind_path(value: str) -> str | None:
    """The CT path of a bind mount point; None for a storage volume or a device (never the role's)."""
    volume, options = _mount(value)
    return options.get("mp", "") if volume.startswith("/") and not volume.startswith("/dev/") else None


def plan_mount_points(current: dict, wanted: list[dict]) -> tuple[dict, list[str]]:
    """(mpN -> value to set, mpN to delete) for the bind mounts (a host path mounted at a CT path): each
    wanted CT path exactly once, existing indexes kept. Storage volumes (local-lvm:vm-200-disk-1) hold data
    and are never touched; a bind mount at a CT path not wanted is removed (the host's data stays)."""
    return _plan(
        "mp",
        current,
        wanted,
        _bind_path,
        mount_value,
        lambda old, mount: _mount(old) == _mount(mount_value(mount)),
    )


def repeated_paths(vmid: int, devices: list[dict], mount_points: list[dict]) -> str | None:
    """The error for a device or a CT mount path listed twice, else None."""
    for what, entries in (("device list", devices), ("mount point list", mount_points)):
        paths = [entry["path"] for entry in entries]
        dupes = sorted({p for p in paths if paths.count(p) > 1})
        if dupes:
            return f"{what} for CT {vmid} names {dupes} more than once"
    return None


def plan_entries(current: dict, devices: list[dict], mount_points: list[dict]) -> tuple[dict, list[str]]:
    """Both plans, for one `pct set` or one API call."""
    sets, deletes = plan_devices(current, devices)
    mp_sets, mp_deletes = plan_mount_points(current, mount_points)
    return sets | mp_sets, deletes + mp_deletes
