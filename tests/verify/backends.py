"""testinfra backends for the two ways this project reaches a container: lxc-attach in the lab, and
`pct exec` through the Proxmox host's SSH on a real host (CT 200 runs no sshd)."""

from __future__ import annotations

import shlex
from typing import Any

import testinfra.host
from testinfra.backend import base


class LxcAttachBackend(base.BaseBackend):
    NAME = "lxc-attach"

    def __init__(self, name: str, *args: Any, **kwargs: Any):
        self.name = name
        super().__init__(name, *args, **kwargs)

    def run(self, command: str, *args: str, **kwargs: Any) -> base.CommandResult:
        cmd = self.get_command(command, *args)
        for _attempt in range(3):
            out = self.run_local("lxc-attach -n %s -- /bin/sh -c %s", self.name, cmd)
            if not rexec_failed(out.rc, out.stderr):
                break
        out.command = self.encode(cmd)
        return out


# lxc-attach re-executes itself from a sealed memfd before main() (liblxc src/lxc/rexec.c, a constructor; the
# CVE-2019-5736 guard). On a loaded machine that step can fail with "Device or resource busy - Failed to
# rexec as memfd" and abort (exit 134): nothing ran in the container, so the command is started again.
def rexec_failed(rc: int, stderr: str) -> bool:
    return rc == 134 and "Failed to rexec as memfd" in stderr


class PctExecBackend(base.BaseBackend):
    NAME = "pct-exec"

    def __init__(self, proxmox_host: str, vmid: int, user: str = "root", *args: Any, **kwargs: Any):
        self.proxmox_host, self.vmid, self.user = proxmox_host, vmid, user
        super().__init__(f"{proxmox_host}/{vmid}", *args, **kwargs)

    def run(self, command: str, *args: str, **kwargs: Any) -> base.CommandResult:
        cmd = self.get_command(command, *args)
        remote = f"pct exec {self.vmid} -- /bin/sh -c {shlex.quote(cmd)}"
        out = self.run_local("ssh -o BatchMode=yes %s@%s %s", self.user, self.proxmox_host, remote)
        out.command = self.encode(cmd)
        return out


def host_for(
    name: str, hostvars: dict[str, Any], all_hostvars: dict[str, dict[str, Any]]
) -> testinfra.host.Host:
    """The testinfra host for an inventory host, by its Ansible connection."""
    connection = hostvars.get("ansible_connection", "ssh")
    address = hostvars.get("ansible_host", name)
    if connection in ("community.general.lxc", "lxc"):
        return testinfra.host.Host(LxcAttachBackend(address))
    if connection == "community.proxmox.proxmox_pct_remote":
        proxmox = hostvars.get("ct_proxmox_host", address)
        proxmox_address = all_hostvars.get(proxmox, {}).get("ansible_host", proxmox)
        return testinfra.host.Host(
            PctExecBackend(proxmox_address, int(hostvars["ct_vmid"]), hostvars.get("ansible_user", "root"))
        )
    if connection in ("ssh", "smart", "paramiko_ssh"):
        user = hostvars.get("ansible_user", "root")
        return testinfra.get_host(f"ssh://{user}@{address}", ssh_config=None)
    if connection == "local":
        return testinfra.get_host("local://")
    raise ValueError(f"host {name}: no testinfra backend for ansible_connection={connection}")
