"""L0's pins must exist in the host's repositories: a kernel or headers package apt has no candidate for is
refused by the preflight, in one line naming the host, the package and what apt has of the same series, before
anything on the host changes (apt's lists aside)."""

from __future__ import annotations

import json

from tests.host.conftest import attach, playbook, snapshot

L0 = "ansible/l0_host.yml"
MISSING = "6.1.0-999-amd64"  # a Debian 12 kernel release that does not exist


def packages() -> str:
    """The kernel packages dpkg knows and their selections (install, hold)."""
    return attach("sh", "-c", "dpkg --get-selections 'linux-*' 'proxmox-*' 2>/dev/null; true").stdout


def test_a_pin_apt_does_not_have_is_refused_naming_what_it_has(lab_host):
    before = (snapshot(), packages())
    extra = {"host_kernel_version": MISSING, "host_kernel_packages": [f"linux-headers-{MISSING}"]}
    proc = playbook(L0, "-e", json.dumps(extra))
    out = " ".join(proc.stdout.split())
    assert proc.returncode != 0, out[-2000:]
    assert f"host lab-host: apt has no candidate for linux-headers-{MISSING}" in out, out[-2000:]
    # lab-host's pin (inventory/lab) is the bookworm kernel ABI apt has; the refusal must offer it.
    assert "(apt has of the 6.1 series: linux-headers-6.1.0-50-amd64" in out, out[-2000:]
    assert "linux-headers-6.1.0-50-cloud-amd64" not in out, "offers another flavour than -amd64"
    assert "nothing was changed" in out
    assert (snapshot(), packages()) == before
