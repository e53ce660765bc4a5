"""Bad input to L0/L1 stops the play before the running kernel or the boot configuration is touched, with one
line that names the cause; the lab host is left exactly as it was."""

from __future__ import annotations

import hashlib
import io
import tarfile

import pytest

from tests.l0_l1_host.boot_standin import ProxmoxHost, running_kernel
from tests.l0_l1_host.conftest import attach, playbook, snapshot

L1 = "ansible/l1_driver.yml"
L0 = "ansible/l0_host.yml"


def run_refused(*extra: str, play: str = L1) -> str:
    """Runs the play with bad input; returns its output on one line once it failed and changed nothing."""
    before = snapshot()
    proc = playbook(play, *extra)
    after = snapshot()
    out = " ".join(proc.stdout.split())
    assert proc.returncode != 0, f"the play succeeded on bad input: {out[-2000:]}"
    assert before == after, f"the host changed on bad input:\nbefore:\n{before}\nafter:\n{after}"
    return out


def test_version_without_checksum_is_refused(lab_host):
    out = run_refused("-e", "nvidia_driver_source_sha256=''")
    assert "nvidia_driver_source_sha256 is not set for NVIDIA 535.261.03" in out
    assert "a version without a checksum is refused" in out


def test_branch_older_than_minimum_is_refused(lab_host):
    out = run_refused("-e", "nvidia_driver_version=470.256.02", "-e", "nvidia_driver_min_branch=580")
    assert 'nvidia_driver_version="470.256.02" is not a pinned driver release of branch 580 or newer' in out


def test_checksum_mismatch_is_refused(lab_host):
    out = run_refused("-e", "nvidia_driver_source_sha256=" + "0" * 64)
    failure = out[out.find("FAILED!") :][:1500]  # the failing task's message, should this test fail
    assert "refused, nothing was built or changed" in out, failure
    assert "did not match" in out, failure


def test_missing_headers_are_refused(lab_host):
    out = run_refused("-e", "nvidia_driver_kernel_version=6.1.0-47-amd64")
    assert "kernel headers for 6.1.0-47-amd64 are missing" in out


def test_bad_kernel_version_is_refused(lab_host):
    out = run_refused("-e", "host_kernel_version=latest", play=L0)
    assert 'host_kernel_version="latest" is not a kernel release' in out


def test_driver_branch_too_old_for_the_kernel_is_refused(lab_host):
    """550.163.01 and 555.58.02 fail to build on 6.17.13-pve (NVIDIA/open-gpu-kernel-modules#1143): refused
    before the kernel's headers are even looked for."""
    out = run_refused(
        "-e",
        '{"nvidia_driver_version": "550.163.01", "nvidia_driver_kernel_version": "6.17.13-2-pve"}',
    )
    assert "NVIDIA 550.163.01 (branch 550) is known to build up to kernel 6.15, not 6.17.13-2-pve" in out, (
        out[-2000:]
    )
    assert "nvidia_driver_verified_builds" in out


def test_driver_branch_check_can_be_overridden_for_a_verified_build(lab_host):
    """An operator who built the pair on a test host lists it; the play then goes on to the next check."""
    out = run_refused(
        "-e",
        '{"nvidia_driver_version": "550.163.01", "nvidia_driver_kernel_version": "6.17.13-2-pve",'
        ' "nvidia_driver_verified_builds": ["550.163.01@6.17.13-2-pve"]}',
    )
    assert "is known to build up to kernel" not in out
    assert "kernel headers for 6.17.13-2-pve are missing" in out, out[-2000:]


def broken_source(tmp_path, version: str):
    """A tree shaped like NVIDIA's kernel-open whose build fails at once, as a too-new kernel's API would."""
    buf = io.BytesIO()
    files = {
        "Kbuild": "obj-m := nvidia.o\n",
        "Makefile": "modules:\n\t@echo 'nv.c: error: implicit declaration (deliberately broken)'; false\n",
        "nvidia/nv.c": "#error deliberately broken\n",
    }
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"broken-{version}/{name}")
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    path = tmp_path / f"broken-{version}.tar.gz"
    path.write_bytes(buf.getvalue())
    return path, hashlib.sha256(buf.getvalue()).hexdigest()


@pytest.mark.parametrize("version", ["535.999.99"])
def test_source_that_does_not_build_leaves_nothing(lab_host, tmp_path, version):
    source, digest = broken_source(tmp_path, version)
    try:
        out = run_refused(
            "-e",
            f"nvidia_driver_version={version}",
            "-e",
            f"nvidia_driver_source_file={source}",
            "-e",
            f"nvidia_driver_source_sha256={digest}",
            "-e",
            "nvidia_driver_source_strip_components=1",
        )
    finally:
        attach("sh", "-c", f"rm -f /var/cache/dflash/nvidia/*{version}*")
    assert f"NVIDIA {version} did not build for kernel 6.1.0-50-amd64" in out
    assert "boot configuration untouched" in out
    assert "deliberately broken" in out or "make-" in out


def test_trial_boot_refused_without_the_module(lab_host):
    """A kernel whose NVIDIA module was never built is not booted: no pin, no one-shot entry, no reboot."""
    host = ProxmoxHost("grub", ["6.1.0-47-amd64", running_kernel()])
    host.install()
    try:
        host.pin(running_kernel())
        before = host.calls()
        out = run_refused("-e", "host_kernel_version=6.1.0-47-amd64", play="tests/l0_l1_host/trial_boot.yml")
        calls = host.calls()[len(before) :]
    finally:
        host.remove()
    assert "refusing to boot 6.1.0-47-amd64: module(s) nvidia, nvidia-uvm not built for it" in out
    assert calls == ["status"], f"the boot configuration was touched: {calls}"


def test_tarball_that_is_not_the_module_source_leaves_nothing(lab_host, tmp_path):
    source, digest = broken_source(tmp_path, "535.999.98")
    try:
        out = run_refused(
            "-e",
            "nvidia_driver_version=535.999.98",
            "-e",
            f"nvidia_driver_source_file={source}",
            "-e",
            f"nvidia_driver_source_sha256={digest}",
            "-e",
            "nvidia_driver_source_strip_components=2",
        )
    finally:
        attach("sh", "-c", "rm -f /var/cache/dflash/nvidia/*535.999.98*")
    assert "has neither kernel-open/Kbuild nor Kbuild at its top" in out
    assert "nvidia_driver_source_strip_components=2 is wrong" in out
    assert attach("test", "-e", "/usr/src/nvidia-535.999.98.partial").returncode != 0


def test_kernel_bump_with_another_driver_registered_is_refused(lab_host):
    """A new kernel's headers would make DKMS autoinstall the registered (old) driver for it; with a driver
    bump in the same run L0 refuses before apt runs. A tiny DKMS module stands in for the old NVIDIA one."""
    tree = "/usr/src/labguard-1.0"
    conf = (
        'PACKAGE_NAME="labguard"\\nPACKAGE_VERSION="1.0"\\nAUTOINSTALL="yes"\\n'
        'BUILT_MODULE_NAME[0]="labguard"\\nDEST_MODULE_LOCATION[0]="/updates/dkms"\\n'
    )
    setup = attach("sh", "-ec", f"mkdir -p {tree}; printf '{conf}' > {tree}/dkms.conf; dkms add labguard/1.0")
    assert setup.returncode == 0, setup.stderr
    try:
        out = run_refused(
            "-e",
            '{"host_kernel_version": "6.1.0-47-amd64",'
            ' "host_kernel_packages": ["linux-headers-6.1.0-47-amd64"],'
            ' "host_kernel_dkms_expected": {"labguard": "2.0"}}',
            play=L0,
        )
    finally:
        attach("sh", "-c", f"dkms remove labguard/1.0 --all; rm -rf {tree}")
    assert "refusing to install kernel 6.1.0-47-amd64" in out, out[-2000:]
    assert "dkms autoinstall for labguard/1.0, not the version(s) L1 builds (labguard/2.0)" in out
    assert "Bump the driver first" in out
