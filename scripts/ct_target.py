#!/usr/bin/env python3
"""How the operator scripts (make status, make logs, make tensorboard) reach an inventory's training CT.

`ct_target.py INVENTORY [--tty]` reads the inventory through `ansible-inventory --list`, takes the first
host of group training_cts and prints shell assignments for the scripts to eval:

  ct_host     the CT's inventory name
  ct_kind     lxc (lxc-attach on this machine: the lab), ssh (to the CT itself) or pct (ssh to its Proxmox
              host, then `pct exec`), from the CT's ansible_connection
  ct_address  lxc: the container's name; ssh: the CT's address; pct: the Proxmox host's address
  ct_vmid     pct: the CT's ct_vmid (empty otherwise)
  ct_user     ssh and pct: the ssh user (ansible_user, default root; empty for lxc)
  ct_venv     the trainer environment in the CT (ct_venv_dir, default /opt/dflash/venv)
  ct_exec     a bash array: the command prefix that runs a command in the CT (--tty: ssh with -t)

It exits non-zero with one line naming the inventory (and the host) at fault. Needs ansible-inventory on PATH
(the tools venv: make bootstrap).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

LXC = ("community.general.lxc", "lxc")
PCT = "community.proxmox.proxmox_pct_remote"
DEFAULT_VENV = "/opt/dflash/venv"


class TargetError(Exception):
    """The inventory cannot say how to reach its training CT; the message names the file and the host."""


@dataclass(frozen=True)
class Target:
    host: str
    kind: str  # lxc | ssh | pct
    address: str
    vmid: str
    user: str
    venv: str

    def exec_prefix(self, *, tty: bool = False) -> list[str]:
        """The words before a command that run it in the CT."""
        if self.kind == "lxc":
            return ["lxc-attach", "-n", self.address, "--"]
        ssh = ["ssh", "-o", "BatchMode=yes", *(["-t"] if tty else []), f"{self.user}@{self.address}"]
        return [*ssh, "pct", "exec", self.vmid, "--"] if self.kind == "pct" else ssh

    def shell(self, *, tty: bool = False) -> str:
        """Assignments for bash's eval (every value quoted)."""
        fields = {
            "ct_host": self.host,
            "ct_kind": self.kind,
            "ct_address": self.address,
            "ct_vmid": self.vmid,
            "ct_user": self.user,
            "ct_venv": self.venv,
        }
        lines = [f"{k}={shlex.quote(v)}" for k, v in fields.items()]
        lines.append(f"ct_exec=({shlex.join(self.exec_prefix(tty=tty))})")
        return "\n".join(lines) + "\n"


def target_of(inventory: dict, source: str) -> Target:
    """The first training CT of `ansible-inventory --list`'s JSON; `source` names the inventory in errors."""
    hosts = inventory.get("training_cts", {}).get("hosts", [])
    if not hosts:
        raise TargetError(f"{source}: no host in group training_cts")
    hostvars = inventory.get("_meta", {}).get("hostvars", {})
    host = hosts[0]
    v = hostvars.get(host, {})
    venv = str(v.get("ct_venv_dir", DEFAULT_VENV))
    conn = v.get("ansible_connection", "ssh")
    if conn in LXC:
        return Target(host, "lxc", str(v.get("ansible_host", host)), "", "", venv)
    user = str(v.get("ansible_user", "root"))
    if conn == PCT:
        if "ct_vmid" not in v:
            raise TargetError(f"{source}: host {host} (ansible_connection {conn}) has no ct_vmid")
        proxmox = v.get("ct_proxmox_host", v.get("ansible_host"))
        if not proxmox:
            raise TargetError(
                f"{source}: host {host} (ansible_connection {conn}) names no Proxmox host: set "
                "ct_proxmox_host (its inventory name) or ansible_host (its address)"
            )
        address = hostvars.get(proxmox, {}).get("ansible_host", proxmox)
        return Target(host, "pct", str(address), str(v["ct_vmid"]), user, venv)
    return Target(host, "ssh", str(v.get("ansible_host", host)), "", user, venv)


def read_inventory(path: str) -> dict:
    """`ansible-inventory -i PATH --list`, parsed."""
    if not Path(path).exists():
        raise TargetError(f"INVENTORY={path}: no such file or directory")
    # A file Ansible cannot parse fails with its reason, instead of an empty inventory and a warning.
    env = os.environ | {"ANSIBLE_INVENTORY_UNPARSED_FAILED": "True"}
    try:
        proc = subprocess.run(
            ["ansible-inventory", "-i", path, "--list"], capture_output=True, text=True, env=env
        )
    except FileNotFoundError:
        missing = "ansible-inventory is not on PATH (the tools venv: make bootstrap)"
        raise TargetError(f"{path}: {missing}") from None
    if proc.returncode != 0:
        raise TargetError(f"{path}: ansible-inventory failed: {proc.stderr.strip()[-300:]}")
    return json.loads(proc.stdout)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("inventory")
    parser.add_argument("--tty", action="store_true", help="ssh with -t (an interactive follower: make logs)")
    args = parser.parse_args(argv)
    try:
        target = target_of(read_inventory(args.inventory), args.inventory)
    except TargetError as e:
        print(e, file=sys.stderr)
        return 1
    sys.stdout.write(target.shell(tty=args.tty))
    return 0


if __name__ == "__main__":
    sys.exit(main())
