"""L0's kernel pins and L1's trial boot against lab-host dressed as a Proxmox host
(tests/l0_l1_host/boot_standin.py: lab/boot_standin imitates proxmox-boot-tool, the boot loaders and
proxmox-boot-cleanup.service, read from proxmox-kernel-helper's sources, and GRUB's grubenv handling from
grub2's sources). For every kind of host, systemd-boot on ESPs the tool manages (ZFS root), GRUB on a /boot
partition and GRUB on LVM (the default ext4/LVM install): a pin the play makes is the kernel the next boot
starts. A trial boot starts the new kernel once, whether it comes up, hangs or panics; where GRUB cannot make
it a one-shot it is refused and nothing is armed."""

from __future__ import annotations

import json

import pytest

from tests.l0_l1_host.boot_standin import (
    ProxmoxHost,
    apt_update_only,
    put_kernel_package_repository,
    running_kernel,
    sh,
)
from tests.l0_l1_host.conftest import playbook, snapshot

OLD = "6.1.0-40-amd64"  # a known-good kernel the host was pinned to before
NEW = "6.1.0-99-amd64"  # a trial kernel (only its image exists: the arm step checks no modules here)
MODES = ["systemd-boot", "grub", "grub-lvm"]
ONE_SHOT_MODES = ["systemd-boot", "grub"]


def make_host(mode: str):
    host = ProxmoxHost(mode, [OLD, NEW, running_kernel()])
    host.install()
    try:
        yield host
    finally:
        host.remove()


@pytest.fixture(params=MODES)
def pve_host(request, lab_host):
    yield from make_host(request.param)


@pytest.fixture(params=ONE_SHOT_MODES)
def one_shot_host(request, lab_host):
    yield from make_host(request.param)


@pytest.fixture
def grub_host(lab_host):
    yield from make_host("grub")


@pytest.fixture
def grub_lvm_host(lab_host):
    yield from make_host("grub-lvm")


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
    out = run("ansible/l0_host.yml")
    assert pve_host.boot() == running, pve_host.calls()
    # The lab pins a kernel that does not run: on GRUB on LVM L0 says that its trial will be refused.
    assert ("L1 will refuse its trial boot: /boot/grub is on lvm" in out) == (pve_host.mode == "grub-lvm"), (
        out[-2000:]
    )
    # bootctl's package comes with L0 on systemd-boot hosts, before any trial needs it.
    assert pve_host.bootctl_installed() == (pve_host.mode == "systemd-boot")


RUNNING_REPO = "/var/lib/lab-running-kernel/repo"
RUNNING_LIST = "/etc/apt/sources.list.d/lab-running-kernel.list"
RUNNING_LISTS = "/var/lib/apt/lists/_var_lib_lab-running-kernel_repo_*"


@pytest.fixture
def running_kernel_package(lab_host):
    """A headers package of the kernel lab-host runs, in a repository of its own: what a PVE host's
    repositories hold for the kernel it was installed with. Yields (kernel, package); purged afterwards."""
    kernel = running_kernel()
    package = f"lab-pin-headers-{kernel}"
    put_kernel_package_repository(RUNNING_REPO, RUNNING_LIST, package)
    sh(apt_update_only(RUNNING_LIST))
    try:
        yield kernel, package
    finally:
        sh(
            f"apt-mark unhold {package} >/dev/null 2>&1 || true;"
            f" apt-get purge -y -qq -o DPkg::Lock::Timeout=120 {package} >/dev/null 2>&1 || true;"
            f" rm -rf /var/lib/lab-running-kernel {RUNNING_LIST} {RUNNING_LISTS}"
        )


def test_a_host_installed_with_the_pinned_kernel_gets_it_pinned(grub_host, running_kernel_package):
    """A fresh host that already runs host_kernel_version has no pin: L0 must pin it (Verify L0 demands a
    permanent pin, and a later kernel package would otherwise become the default boot entry by being the
    newest), the boot must start it, and a second run changes nothing."""
    kernel, package = running_kernel_package
    extra = json.dumps(
        {"host_kernel_version": kernel, "host_kernel_packages": [package], "host_kernel_dkms_expected": {}}
    )
    assert "etc/kernel/proxmox-boot-pin" not in grub_host.boot_state()
    run("ansible/l0_host.yml", "-e", extra)
    assert f"etc/kernel/proxmox-boot-pin: {kernel}" in grub_host.boot_state(), grub_host.boot_state()
    assert grub_host.boot() == kernel, grub_host.calls()
    again = run("ansible/l0_host.yml", "-e", extra)
    assert "changed=0" in again, again[-2000:]


def test_commit_pin_is_what_boots(pve_host):
    """The commit after a good trial boot pins the kernel that runs; every later boot must start it."""
    pve_host.pin(OLD)
    running = running_kernel()
    run("tests/l0_l1_host/commit.yml", "-e", f"host_kernel_version={running}")
    assert pve_host.boot() == running, pve_host.calls()
    assert pve_host.boot() == running


@pytest.mark.parametrize("outcome", ["ok", "hang", "panic"])
def test_trial_boot_starts_the_new_kernel_once(one_shot_host, outcome):
    """Armed by the play, the next boot starts NEW; the one after it starts the pinned kernel again, whether
    NEW came up (no commit yet), hung before userspace (power cycle) or panicked (kernel.panic reboots it).
    On systemd-boot the play first installs bootctl's package: PVE 9 does not install it with the kernel."""
    running = running_kernel()
    one_shot_host.pin(running)
    run("tests/l0_l1_host/trial_arm.yml", "-e", f"host_kernel_version={NEW}")
    if one_shot_host.mode == "systemd-boot":
        assert one_shot_host.bootctl_installed(), (
            "the play armed systemd-boot without installing systemd-boot-tools"
        )
    assert one_shot_host.boot(outcome) == NEW, one_shot_host.calls()
    assert one_shot_host.boot("ok") == running, f"not a one-shot: {one_shot_host.calls()}"
    assert one_shot_host.boot("ok") == running


def test_trial_boot_on_grub_lvm_is_refused(grub_lvm_host):
    """GRUB on LVM cannot clear next_entry (its save_env cannot write through LVM), so grub-reboot is no
    one-shot there: a NEW that hangs would boot again on every power cycle. The play must refuse, say why and
    what to do, and leave the boot configuration as it was: the next boots start the pinned kernel."""
    running = running_kernel()
    grub_lvm_host.pin(running)
    before, boot_before = snapshot(), grub_lvm_host.boot_state()
    proc = playbook("tests/l0_l1_host/trial_arm.yml", "-e", f"host_kernel_version={NEW}")
    out = " ".join(proc.stdout.split())
    after, boot_after = snapshot(), grub_lvm_host.boot_state()
    first, second = grub_lvm_host.boot("hang"), grub_lvm_host.boot("ok")
    assert second == running, f"not a one-shot: after a hang of {first} the next boot started {second} again"
    assert proc.returncode != 0, f"armed a trial boot GRUB cannot make a one-shot: {out[-1500:]}"
    assert "refusing to arm a trial boot of 6.1.0-99-amd64" in out, out[-2000:]
    assert "lvm" in out and "docs/host-layers.md" in out and "nothing was changed" in out, out[-2000:]
    assert (after, boot_after) == (before, boot_before)
    assert first == running
