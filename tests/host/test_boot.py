"""L0's kernel pins and L1's trial boot against lab-host dressed as a Proxmox host
(tests/host/boot_standin.py: lab/boot_standin imitates proxmox-boot-tool, the boot loaders and
proxmox-boot-cleanup.service, read from proxmox-kernel-helper's sources). For both kinds of host, systemd-boot
on ESPs the tool manages (ZFS root) and plain GRUB: a pin the play makes is the kernel the next boot starts,
and a trial boot starts the new kernel once, whether it comes up, hangs or panics."""

from __future__ import annotations

import pytest

from tests.host.boot_standin import ProxmoxHost, running_kernel
from tests.host.conftest import playbook

OLD = "6.1.0-40-amd64"  # a known-good kernel the host was pinned to before
NEW = "6.1.0-99-amd64"  # a trial kernel (only its image exists: the arm step checks no modules here)
MODES = ["systemd-boot", "grub"]


@pytest.fixture(params=MODES)
def pve_host(request, lab_host):
    host = ProxmoxHost(request.param, [OLD, NEW, running_kernel()])
    host.install()
    try:
        yield host
    finally:
        host.remove()


def run(play: str, *extra: str) -> str:
    proc = playbook(play, *extra)
    out = " ".join(proc.stdout.split())
    assert proc.returncode == 0, out[-3000:]
    return out


def test_l0_pin_of_the_running_kernel_is_what_boots(pve_host):
    """The host runs a kernel picked by hand while the pin names OLD: L0 pins the running kernel, and the boot
    loader must follow (on managed ESPs only `refresh` writes the pin into loader.conf)."""
    pve_host.pin(OLD)
    running = running_kernel()
    run("ansible/l0_host.yml")
    assert pve_host.boot() == running, pve_host.calls()


def test_commit_pin_is_what_boots(pve_host):
    """The commit after a good trial boot pins the kernel that runs; every later boot must start it."""
    pve_host.pin(OLD)
    running = running_kernel()
    run("tests/host/commit.yml", "-e", f"host_kernel_version={running}")
    assert pve_host.boot() == running, pve_host.calls()
    assert pve_host.boot() == running


@pytest.mark.parametrize("outcome", ["ok", "hang", "panic"])
def test_trial_boot_starts_the_new_kernel_once(pve_host, outcome):
    """Armed by the play, the next boot starts NEW; the one after it starts the pinned kernel again, whether
    NEW came up (no commit yet), hung before userspace (power cycle) or panicked (kernel.panic reboots it)."""
    running = running_kernel()
    pve_host.pin(running)
    run("tests/host/trial_arm.yml", "-e", f"host_kernel_version={NEW}")
    assert pve_host.boot(outcome) == NEW, pve_host.calls()
    assert pve_host.boot("ok") == running, f"not a one-shot: {pve_host.calls()}"
    assert pve_host.boot("ok") == running
