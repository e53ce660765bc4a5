"""Makes lab-host look like a Proxmox host for one test: lab/boot_standin's proxmox-boot-tool, pveversion,
update-grub, grub-reboot, grub-probe and lab-boot (the firmware and boot loader), with kernel images in /boot,
and bootctl only as the package systemd-boot-tools of a local apt repository (on PVE 9 a host may lack it).
Everything installed is removed afterwards, so the lab host is as `make lab` left it."""

from __future__ import annotations

import hashlib
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tests.l0_l1_host.conftest import HOST, attach

STANDIN = Path(__file__).resolve().parents[2] / "lab" / "boot_standin"
INSTALL = {
    "proxmox-boot-tool": "/usr/sbin/proxmox-boot-tool",
    "pveversion": "/usr/bin/pveversion",
    "update-grub": "/usr/local/sbin/update-grub",
    "grub-reboot": "/usr/local/sbin/grub-reboot",
    "grub-probe": "/usr/local/sbin/grub-probe",
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
# What the storage under /boot/grub is to grub-probe (lab/boot_standin/grub-probe), per kind of host.
GRUB_PROBE = {
    "systemd-boot": "abstraction=\nfs=zfs\n",
    "grub": "abstraction=\nfs=ext2\n",
    "grub-lvm": "abstraction=lvm\nfs=ext2\n",
}
# bootctl as trixie ships it (/usr/bin/bootctl in systemd-boot-tools), in a flat file: repository, unsigned.
BOOTCTL_PACKAGE = "systemd-boot-tools"
BOOTCTL_VERSION = "257.8-1~lab1"
BOOTCTL_FIELDS = (
    f"Package: {BOOTCTL_PACKAGE}\nVersion: {BOOTCTL_VERSION}\nArchitecture: all\n"
    "Maintainer: dflash lab <lab@localhost>\n"
)
BOOTCTL_DESCRIPTION = "Description: lab stand-in for bootctl (set-oneshot only)\n"
REPO_DIR = "/var/lib/lab-boot/repo"
REPO_LIST = "/etc/apt/sources.list.d/lab-boot.list"
REPO_LISTS_GLOB = "/var/lib/apt/lists/_var_lib_lab-boot_repo_*"


def apt_update_only(list_path: str) -> str:
    """A script that reads only the index of the repository `list_path` names (the other lists stay as they
    are); it waits out another apt run's lock."""
    return (
        f"for i in $(seq 60); do apt-get update -qq -o Dir::Etc::sourcelist={list_path}"
        " -o Dir::Etc::sourceparts=- -o APT::Get::List-Cleanup=0 && exit 0; sleep 2; done; exit 1"
    )


def sh(script: str) -> str:
    proc = attach("sh", "-ec", script)
    assert proc.returncode == 0, f"on {HOST}: {script}\n{proc.stdout}{proc.stderr}"
    return proc.stdout


def put(dest: str, data: bytes, mode: str = "0644") -> None:
    """Writes data to dest on lab-host (its directory created)."""
    proc = subprocess.run(
        [
            "lxc-attach",
            "-n",
            HOST,
            "--",
            "sh",
            "-c",
            f'mkdir -p "$(dirname {dest})" && cat > {dest} && chmod {mode} {dest}',
        ],
        input=data,
        capture_output=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr


def running_kernel() -> str:
    return sh("uname -r").strip()


def build_deb(control: str, files: dict[str, tuple[bytes, int]] | None = None) -> bytes:
    """A .deb built with dpkg-deb here: DEBIAN/control's text and {path in the package: (bytes, mode)}."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "pkg"
        (root / "DEBIAN").mkdir(parents=True)
        (root / "DEBIAN" / "control").write_text(control)
        for path, (data, mode) in (files or {}).items():
            target = root / path.lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
            target.chmod(mode)
        deb = Path(tmp) / "out.deb"
        subprocess.run(
            ["dpkg-deb", "--root-owner-group", "--build", str(root), str(deb)],
            check=True,
            capture_output=True,
        )
        return deb.read_bytes()


def put_kernel_package_repository(repo_dir: str, list_path: str, package: str) -> None:
    """An apt repository on lab-host holding one empty package of version 1.0 (a kernel package's stand-in:
    L0 asks apt for its candidate, installs and holds it), and the source list that names it."""
    control = (
        f"Package: {package}\nVersion: 1.0\nArchitecture: all\nMaintainer: dflash lab <lab@localhost>\n"
        "Description: lab stand-in for a kernel package\n"
    )
    deb = build_deb(control)
    filename = f"{package}_1.0_all.deb"
    fields = f"Filename: ./{filename}\nSize: {len(deb)}\nSHA256: {hashlib.sha256(deb).hexdigest()}\n"
    put(f"{repo_dir}/{filename}", deb)
    put(f"{repo_dir}/Packages", (control.replace("Description:", fields + "Description:") + "\n").encode())
    put(list_path, f"deb [trusted=yes] file:{repo_dir} ./\n".encode())


def bootctl_deb() -> bytes:
    """The stand-in package: /usr/bin/bootctl from lab/boot_standin."""
    bootctl = (STANDIN / "bootctl").read_bytes()
    return build_deb(BOOTCTL_FIELDS + BOOTCTL_DESCRIPTION, {"/usr/bin/bootctl": (bootctl, 0o755)})


def packages_index(deb: bytes, filename: str) -> bytes:
    """A Packages stanza as dpkg-scanpackages writes it (the fields apt checks: Filename, Size, SHA256)."""
    digest = hashlib.sha256(deb).hexdigest()
    fields = f"Filename: ./{filename}\nSize: {len(deb)}\nSHA256: {digest}\n"
    return (BOOTCTL_FIELDS + fields + BOOTCTL_DESCRIPTION + "\n").encode()


@dataclass
class ProxmoxHost:
    """mode: 'systemd-boot' (UEFI, ESPs managed by proxmox-boot-tool: every ZFS-root install), 'grub' (GRUB
    on a /boot partition of its own, no managed ESPs), or 'grub-lvm' (UEFI, GRUB with /boot on the root LV,
    no managed ESPs: the default ext4/LVM install, where GRUB cannot write its grubenv)."""

    mode: str
    kernels: list[str]

    def install(self) -> None:
        for name, dest in INSTALL.items():
            put(dest, (STANDIN / name).read_bytes(), "0755")
        put("/var/lib/lab-boot/grub-probe", GRUB_PROBE[self.mode].encode())
        images = " ".join(f"/boot/vmlinuz-{k}" for k in self.kernels)
        firmware = "bios" if self.mode == "grub" else "uefi"
        esp = "echo ABCD-0001 > /etc/kernel/proxmox-boot-uuids" if self.mode == "systemd-boot" else "true"
        sh(
            f"mkdir -p /var/lib/lab-boot /etc/kernel /boot; echo {firmware} > /var/lib/lab-boot/firmware;"
            f" : > /var/lib/lab-boot/calls.log;"
            f" for f in {images}; do [ -e $f ] || {{ : > $f; : > $f.lab-boot; }}; done; {esp};"
            " update-grub 2>/dev/null; proxmox-boot-tool refresh >/dev/null 2>&1"
        )
        self.bootctl_repository()

    def bootctl_repository(self) -> None:
        """bootctl can be had only by installing systemd-boot-tools, as on PVE 9; nothing else provides it."""
        assert attach("sh", "-c", "command -v bootctl").returncode != 0, f"{HOST} has a bootctl of its own"
        deb = bootctl_deb()
        filename = f"{BOOTCTL_PACKAGE}_{BOOTCTL_VERSION}_all.deb"
        put(f"{REPO_DIR}/{filename}", deb)
        put(f"{REPO_DIR}/Packages", packages_index(deb, filename))
        put(REPO_LIST, f"deb [trusted=yes] file:{REPO_DIR} ./\n".encode())
        sh(apt_update_only(REPO_LIST))
        assert f"Candidate: {BOOTCTL_VERSION}" in sh(f"apt-cache policy {BOOTCTL_PACKAGE}")

    def remove(self) -> None:
        made = list(INSTALL.values())
        sh(
            f"if dpkg-query -W -f '${{Status}}' {BOOTCTL_PACKAGE} 2>/dev/null | grep -q ' installed'; then"
            f" apt-get purge -y -qq -o DPkg::Lock::Timeout=120 {BOOTCTL_PACKAGE} >/dev/null; fi;"
            'for f in /boot/*.lab-boot; do [ -e "$f" ] && rm -f "$f" "${f%.lab-boot}"; done; true;'
            f" rm -rf {' '.join(made + STATE)} {REPO_LIST} {REPO_LISTS_GLOB}"
        )

    def pin(self, kernel: str) -> None:
        """What an operator once did by hand: pin a kernel and let the boot loader follow."""
        sh(f"proxmox-boot-tool kernel pin {kernel} >/dev/null; proxmox-boot-tool refresh >/dev/null 2>&1")

    def boot(self, outcome: str = "ok") -> str:
        """One power-on; returns the kernel the boot loader started."""
        return sh(f"lab-boot {outcome}").strip().removeprefix("booted ")

    def calls(self) -> list[str]:
        return sh("cat /var/lib/lab-boot/calls.log").splitlines()

    def boot_state(self) -> str:
        """Everything a trial arm may write: pins, GRUB's default and grubenv, loader.conf, EFI variables."""
        return sh(
            "cd /; for f in etc/kernel/proxmox-boot-pin etc/kernel/next-boot-pin etc/default/grub.d/*.cfg"
            " boot/grub/grubenv var/lib/lab-boot/esp/loader/loader.conf var/lib/lab-boot/efivars/*;"
            ' do [ -f "$f" ] && echo "$f: $(cat "$f")"; done; true'
        )

    def bootctl_installed(self) -> bool:
        return attach("dpkg-query", "-W", "-f", "${Status}", BOOTCTL_PACKAGE).stdout.endswith(" installed")
