"""Secure Boot: with it on, the kernel loads only modules signed by a key it trusts. DKMS signs the NVIDIA
module with its own key (/var/lib/dkms/mok.pub); unless that key is enrolled as a MOK, the module built before
the trial boot does not load after it. L1's preflight refuses that case with the steps to enroll, and changes
nothing. lab/nvidia_standin/mokutil plays the firmware (lcp/mokutil src/mokutil.c's messages and statuses)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.l0_l1_host.conftest import attach, install_standin, playbook, put, snapshot

L1 = "ansible/l1_driver.yml"
CERT = "/root/lab-dkms-mok.pub"  # a DKMS certificate of the test's own; the host's real one is left alone
MOK_STATE = "/var/lib/lab-mok"


def digest(path: str) -> str:
    return attach("sha256sum", path).stdout.split()[0]


@pytest.fixture
def firmware(lab_host: str) -> Iterator[str]:
    """An EFI machine with mokutil (the stand-in) and a DKMS certificate; each test sets Secure Boot."""
    assert attach("test", "-e", "/usr/bin/mokutil").returncode != 0, "lab-host has a mokutil of its own"
    mokutil = install_standin("mokutil")
    put(f"{MOK_STATE}/efi", b"", "0644")
    put(CERT, b"lab DKMS certificate (DER on a real host)\n", "0644")
    yield CERT
    attach("rm", "-rf", mokutil, MOK_STATE, CERT)


def secure_boot(state: str, enrolled: bool = False, pending: bool = False) -> None:
    put(f"{MOK_STATE}/secureboot", f"{state}\n".encode(), "0644")
    for kind, wanted in (("enrolled", enrolled), ("pending", pending)):
        attach("rm", "-rf", f"{MOK_STATE}/{kind}")
        if wanted:
            put(f"{MOK_STATE}/{kind}/{digest(CERT)}", b"", "0644")


def preflight(*extra: str) -> str:
    proc = playbook(L1, "--tags", "preflight", "-e", f"nvidia_driver_mok_certificate={CERT}", *extra)
    out = " ".join(proc.stdout.split())
    assert proc.returncode == 0, out[-2500:]
    return out


def test_enabled_and_not_enrolled_is_refused(firmware):
    secure_boot("enabled")
    before = snapshot()
    proc = playbook(L1, "-e", f"nvidia_driver_mok_certificate={CERT}")
    after = snapshot()
    out = " ".join(proc.stdout.split())
    assert proc.returncode != 0, f"the play went on with an unenrolled key: {out[-2000:]}"
    assert before == after, f"the host changed:\nbefore:\n{before}\nafter:\n{after}"
    assert f"Secure Boot is enabled and DKMS's signing key {CERT} is not enrolled" in out, out[-2500:]
    assert f"mokutil --import {CERT}" in out and "MokManager" in out


def test_key_imported_but_not_confirmed_is_refused(firmware):
    """mokutil --test-key exits 0 for a key waiting in the enrollment request: the text decides."""
    secure_boot("enabled", pending=True)
    proc = playbook(L1, "--tags", "preflight", "-e", f"nvidia_driver_mok_certificate={CERT}")
    out = " ".join(proc.stdout.split())
    assert proc.returncode != 0, out[-2000:]
    assert "is imported but not yet enrolled" in out, out[-2500:]


def test_enabled_without_the_key_is_refused(firmware):
    secure_boot("enabled")
    missing = "/root/lab-no-such-mok.pub"
    proc = playbook(L1, "--tags", "preflight", "-e", f"nvidia_driver_mok_certificate={missing}")
    out = " ".join(proc.stdout.split())
    assert proc.returncode != 0, out[-2000:]
    assert f"DKMS's signing key {missing} does not exist yet" in out, out[-2500:]


def test_enabled_and_enrolled_passes(firmware):
    secure_boot("enabled", enrolled=True)
    assert f"Secure Boot is enabled and {CERT} is enrolled" in preflight()


def test_disabled_passes(firmware):
    secure_boot("disabled")
    assert "Secure Boot is disabled" in preflight()


def test_bios_machine_passes(firmware):
    attach("rm", "-f", f"{MOK_STATE}/efi")
    assert "no EFI variables" in preflight()
