"""Makes lab-host look like a Proxmox host for one test: lab/boot_standin's proxmox-boot-tool, pveversion,
update-grub, grub-reboot, bootctl and lab-boot (the firmware and boot loader), with kernel images in /boot.
Everything installed is removed afterwards, so the lab host is as `make lab` left it."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

from tests.host.conftest import HOST, attach

STANDIN = Path(__file__).resolve().parents[2] / "lab" / "boot_standin"
INSTALL = {
    "proxmox-boot-tool": "/usr/sbin/proxmox-boot-tool",
    "pveversion": "/usr/bin/pveversion",
    # /usr/local/sbin comes first in PATH: these shadow a real bootctl (systemd) on lab-host.
    "update-grub": "/usr/local/sbin/update-grub",
    "grub-reboot": "/usr/local/sbin/grub-reboot",
    "bootctl": "/usr/local/sbin/bootctl",
    "lab-boot": "/usr/local/sbin/lab-boot",
}
STATE = [
    "/var/lib/lab-boot",
    "/etc/kernel/proxmox-boot-pin",
    "/etc/kernel/next-boot-pin",
    "/etc/kernel/proxmox-boot-uuids",
    "/etc/default/grub.d/proxmox-kernel-pin.cfg",
    "/boot/grub",
]


def sh(script: str) -> str:
    proc = attach("sh", "-ec", script)
    assert proc.returncode == 0, f"on {HOST}: {script}\n{proc.stdout}{proc.stderr}"
    return proc.stdout


def running_kernel() -> str:
    return sh("uname -r").strip()


@dataclass
class ProxmoxHost:
    """mode: 'systemd-boot' (UEFI, ESPs managed by proxmox-boot-tool: every ZFS-root install) or 'grub'
    (plain GRUB on /boot, no managed ESPs: an ext4/LVM install)."""

    mode: str
    kernels: list[str]

    def install(self) -> None:
        for name, dest in INSTALL.items():
            data = (STANDIN / name).read_bytes()
            proc = subprocess.run(
                ["lxc-attach", "-n", HOST, "--", "sh", "-c", f"cat > {dest} && chmod 0755 {dest}"],
                input=data,
                capture_output=True,
                check=False,
            )
            assert proc.returncode == 0, proc.stderr
        images = " ".join(f"/boot/vmlinuz-{k}" for k in self.kernels)
        firmware = "uefi" if self.mode == "systemd-boot" else "bios"
        esp = "echo ABCD-0001 > /etc/kernel/proxmox-boot-uuids" if self.mode == "systemd-boot" else "true"
        sh(
            f"mkdir -p /var/lib/lab-boot /etc/kernel /boot; echo {firmware} > /var/lib/lab-boot/firmware;"
            f" : > /var/lib/lab-boot/calls.log;"
            f" for f in {images}; do [ -e $f ] || {{ : > $f; : > $f.lab-boot; }}; done; {esp};"
            " update-grub 2>/dev/null; proxmox-boot-tool refresh >/dev/null 2>&1"
        )

    def remove(self) -> None:
        made = list(INSTALL.values())
        sh(
            'for f in /boot/*.lab-boot; do [ -e "$f" ] && rm -f "$f" "${f%.lab-boot}"; done; true;'
            f" rm -rf {' '.join(made + STATE)}"
        )

    def pin(self, kernel: str) -> None:
        """What an operator once did by hand: pin a kernel and let the boot loader follow."""
        sh(f"proxmox-boot-tool kernel pin {kernel} >/dev/null; proxmox-boot-tool refresh >/dev/null 2>&1")

    def boot(self, outcome: str = "ok") -> str:
        """One power-on; returns the kernel the boot loader started."""
        return sh(f"lab-boot {outcome}").strip().removeprefix("booted ")

    def calls(self) -> list[str]:
        return sh("cat /var/lib/lab-boot/calls.log").splitlines()
