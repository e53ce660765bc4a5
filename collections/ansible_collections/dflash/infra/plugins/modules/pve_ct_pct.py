#!/usr/bin/python
# Copyright: the dflash project. GNU General Public License v3.0+
"""Ansible module pve_ct_pct: a CT's devN passthrough entries and bind mount points through `pct` on its
Proxmox host."""

from __future__ import annotations

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.dflash.infra.plugins.module_utils.pve_devices import (
    entry_order,
    plan_entries,
    repeated_paths,
)

DOCUMENTATION = r"""
module: pve_ct_pct
short_description: Keep a Proxmox container's devN entries and bind mount points with pct, on the Proxmox host
description:
  - Runs on the Proxmox host as root (the role delegates it there over SSH). devN entries are accepted from
    root@pam only (pve-container PVE/LXC/Config.pm check_ct_modify_config_perm), and C(pct set) as root on the
    host counts as root@pam, so no root password or TOTP is stored anywhere; an API token does the rest of L2.
  - Makes the devN entries exactly the given device paths, each once, keeping the index of a path there.
  - Makes the bind mount points (mpN with a host path; root@pam only as well, "mount point type bind is only
    allowed for root@pam") exactly the given ones, one per CT path; storage volumes are never touched.
options:
  vmid: {description: container id, type: int, required: true}
  devices:
    description: device paths for devN entries, in order (path, and optionally uid, gid, mode)
    type: list
    elements: dict
    default: []
  mount_points:
    description: bind mounts for mpN entries (host_path, path, optionally read_only)
    type: list
    elements: dict
    default: []
  pct: {description: the pct command, type: str, default: pct}
author: dflash project
"""


def parse_config(text: str) -> dict[str, str]:
    """`pct config VMID` prints one `key: value` line per option (description lines too: only devN matter)."""
    config: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(": ")
        if sep and key and " " not in key:
            config[key] = value
    return config


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "vmid": {"type": "int", "required": True},
            "devices": {"type": "list", "elements": "dict", "default": []},
            "mount_points": {"type": "list", "elements": "dict", "default": []},
            "pct": {"type": "str", "default": "pct"},
        },
        supports_check_mode=True,
    )
    p = module.params
    pct = module.get_bin_path(p["pct"], required=False)
    if pct is None:
        module.fail_json(
            msg=f"pct is not on this host's PATH: is it the Proxmox host of CT {p['vmid']} (ct_proxmox_host)?"
        )
    problem = repeated_paths(p["vmid"], p["devices"], p["mount_points"])
    if problem:
        module.fail_json(msg=problem)
    rc, out, err = module.run_command([pct, "config", str(p["vmid"])])
    if rc != 0:
        cause = " ".join(err.split()) or out.strip()
        module.fail_json(msg=f"pct config {p['vmid']} failed (rc {rc}): {cause}")
    sets, deletes = plan_entries(parse_config(out), p["devices"], p["mount_points"])
    result = {"changed": bool(sets or deletes), "set": sets, "deleted": deletes}
    if module.check_mode or not result["changed"]:
        module.exit_json(**result)
    argv = [pct, "set", str(p["vmid"])]
    for key in sorted(sets, key=entry_order):
        argv += [f"-{key}", sets[key]]
    if deletes:
        argv += ["-delete", ",".join(deletes)]
    rc, out, err = module.run_command(argv)
    if rc != 0:
        module.fail_json(
            msg=f"pct set {p['vmid']} (devN and mpN entries) failed (rc {rc}): "
            f"{' '.join(err.split()) or out.strip()}",
            **result,
        )
    module.exit_json(**result)


if __name__ == "__main__":
    main()
