"""L0 host: the pinned kernel and its headers installed and held, kernel.panic set, the boot
pinned to a known-good kernel (Proxmox only). Runbook for a failed check: docs/host-layers.md."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

GROUP = "proxmox_hosts"
DEFAULTS = yaml.safe_load(
    (Path(__file__).resolve().parents[2] / "roles/host_kernel/defaults/main.yml").read_text()
)


def kernel(hostvars: dict[str, Any]) -> str:
    version = hostvars.get("host_kernel_version")
    if not version or "{{" in str(version):
        pytest.fail("host_kernel_version is not set to a kernel release in the inventory")
    return str(version)


def kernel_packages(hostvars: dict[str, Any]) -> list[str]:
    version = kernel(hostvars)
    packages = hostvars.get("host_kernel_packages", DEFAULTS["host_kernel_packages"])
    return [str(p).replace("{{ host_kernel_version }}", version) for p in packages]


def is_proxmox(host) -> bool:
    return host.file("/usr/sbin/proxmox-boot-tool").exists and host.file("/usr/bin/pveversion").exists


def in_container(host) -> bool:
    return host.run("systemd-detect-virt --container").rc == 0


def test_kernel_packages_installed(host, hostvars):
    missing = [p for p in kernel_packages(hostvars) if not host.package(p).is_installed]
    assert not missing, f"kernel packages not installed: {missing}"


def test_kernel_packages_held(host, hostvars):
    if not hostvars.get("host_kernel_hold", True):
        pytest.skip("host_kernel_hold is false in the inventory")
    for package in kernel_packages(hostvars):
        selection = host.check_output("dpkg --get-selections %s", package).split()
        assert selection[-1:] == ["hold"], f"{package} is not held (dpkg selection {selection[-1:]})"


def test_kernel_headers_present(host, hostvars):
    version = kernel(hostvars)
    assert host.file(f"/lib/modules/{version}/build/Makefile").exists, (
        f"no headers for {version} (/lib/modules/.../build)"
    )


def test_panic_reboots(host, hostvars):
    wanted = hostvars.get("host_kernel_sysctl", DEFAULTS["host_kernel_sysctl"])
    path = hostvars.get("host_kernel_sysctl_file", DEFAULTS["host_kernel_sysctl_file"])
    panic = wanted.get("kernel.panic")
    assert panic is not None and int(panic) > 0, (
        "host_kernel_sysctl sets no kernel.panic > 0: a panic would hang"
    )
    content = host.file(path).content_string
    for key, value in wanted.items():
        assert f"{key}={value}" in content.split(), f"{path} lacks {key}={value}"
    if in_container(host):
        return  # a container shares the machine's kernel: the file is the host's intent, not the live value
    assert host.file("/proc/sys/kernel/panic").content_string.strip() == str(panic)


def test_boot_pinned_to_known_good_kernel(host, hostvars):
    if not is_proxmox(host):
        pytest.skip("not a Proxmox host (no proxmox-boot-tool): kernel pins are Proxmox-only")
    version = kernel(hostvars)
    pinned = host.file("/etc/kernel/proxmox-boot-pin")
    assert pinned.exists, "no permanent kernel pin: a new kernel would become the default boot entry"
    pin = pinned.content_string.strip()
    assert host.file(f"/boot/vmlinuz-{pin}").exists, f"pinned kernel {pin} has no image in /boot"
    assert host.file(f"/boot/vmlinuz-{version}").exists, f"pinned kernel {version} has no image in /boot"
    running = host.check_output("uname -r")
    assert pin in (running, version), f"pin {pin} is neither the running kernel {running} nor {version}"
