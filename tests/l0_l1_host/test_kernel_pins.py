"""L0's pins must exist in the host's repositories: a kernel or headers package apt has no candidate for is
refused by the preflight, in one line naming the host, the package and what apt has of the same series, before
anything on the host changes (apt's lists aside). apt's lists are refreshed first when they are older than
host_kernel_apt_cache_valid_time, so a pin that only newer lists have is not refused."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest

from tests.l0_l1_host.boot_standin import put, put_kernel_package_repository, sh
from tests.l0_l1_host.conftest import attach, playbook, snapshot

L0 = "ansible/l0_host.yml"
MISSING = "6.1.0-999-amd64"  # a Debian 12 kernel release that does not exist
NEWER = "6.1.0-998-amd64"  # a release only the lab repository below has
NEWER_PACKAGE = f"lab-pin-headers-{NEWER}"
REPO_DIR = "/var/lib/lab-pins/repo"
REPO_LIST = "/etc/apt/sources.list.d/lab-pins.list"
REPO_LISTS_GLOB = "/var/lib/apt/lists/_var_lib_lab-pins_repo_*"
ENTERPRISE_PORT = 8401
# What enterprise.proxmox.com answers a host without a subscription key: 401 with a Basic challenge, for every
# index apt asks for (pve.proxmox.com/wiki/Package_repositories: "the enterprise repository ... requires a
# valid subscription key"). Served on lab-host's loopback, where /etc/hosts sends the name.
REFUSING_SERVER = f"""
import http.server
class Refuse(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(401)
        self.send_header("WWW-Authenticate", 'Basic realm="Proxmox Enterprise Repository"')
        self.send_header("Content-Length", "0")
        self.end_headers()
    do_HEAD = do_GET
    def log_message(self, *args):
        pass
http.server.ThreadingHTTPServer(("127.0.0.1", {ENTERPRISE_PORT}), Refuse).serve_forever()
"""
# As PVE 9's installer writes them (deb822), on the lab's port; ceph's disabled, as an operator leaves it
# ("No" in apt's any-case boolean). proxmox.sources: an operator's file of two stanzas, the no-subscription
# source disabled for now beside the enterprise one, which is enabled.
PVE_ENTERPRISE = (
    f"Types: deb\nURIs: http://enterprise.proxmox.com:{ENTERPRISE_PORT}/debian/pve\nSuites: trixie\n"
    "Components: pve-enterprise\nTrusted: yes\n"
)
ENTERPRISE_SOURCES = {
    "pve-enterprise.sources": PVE_ENTERPRISE,
    "ceph.sources": f"Types: deb\nURIs: http://enterprise.proxmox.com:{ENTERPRISE_PORT}/debian/ceph-squid\n"
    "Suites: trixie\nComponents: enterprise\nTrusted: yes\nEnabled: No\n",
    "proxmox.sources": "Types: deb\nURIs: http://download.proxmox.com/debian/pve\nSuites: trixie\n"
    f"Components: pve-no-subscription\nEnabled: no\n\n{PVE_ENTERPRISE}",
}


def packages() -> str:
    """The kernel packages dpkg knows and their selections (install, hold)."""
    return attach(
        "sh", "-c", "dpkg --get-selections 'linux-*' 'proxmox-*' 'lab-pin-*' 2>/dev/null; true"
    ).stdout


def refused(*extra: str) -> str:
    proc = playbook(L0, *extra)
    out = " ".join(proc.stdout.split())
    assert proc.returncode != 0, out[-2000:]
    return out


@pytest.fixture
def newer_repository(lab_host: str) -> Iterator[None]:
    """A repository whose package lab-host's apt lists do not know yet (a release since the last update)."""
    put_kernel_package_repository(REPO_DIR, REPO_LIST, NEWER_PACKAGE)
    try:
        yield
    finally:
        sh(f"rm -rf /var/lib/lab-pins {REPO_LIST} {REPO_LISTS_GLOB}")


@pytest.fixture
def enterprise_repository(lab_host: str) -> Iterator[None]:
    """lab-host as a fresh PVE 9 host without a subscription: its enterprise sources answer 401."""
    saved = "/var/lib/lab-enterprise/hosts"  # lab-host's own /etc/hosts, if it has one
    try:
        put("/var/lib/lab-enterprise/server.py", REFUSING_SERVER.encode(), "0644")
        sh(
            f"if [ -e /etc/hosts ]; then cp /etc/hosts {saved}; fi;"
            " echo '127.0.0.1 enterprise.proxmox.com' >> /etc/hosts;"
            " setsid nohup python3 /var/lib/lab-enterprise/server.py >/dev/null 2>&1 < /dev/null &"
            " echo $! > /var/lib/lab-enterprise/pid"
        )
        for name, text in ENTERPRISE_SOURCES.items():
            put(f"/etc/apt/sources.list.d/{name}", text.encode(), "0644")
        yield
    finally:
        files = " ".join(f"/etc/apt/sources.list.d/{name}" for name in ENTERPRISE_SOURCES)
        sh(
            f"kill $(cat /var/lib/lab-enterprise/pid 2>/dev/null) 2>/dev/null || true; rm -f {files};"
            f" if [ -e {saved} ]; then cp {saved} /etc/hosts; else rm -f /etc/hosts; fi;"
            " rm -rf /var/lib/lab-enterprise"
        )


def test_an_enterprise_repository_without_a_subscription_is_named(enterprise_repository):
    """The first apt refresh of a fresh PVE 9 host fails on its enterprise sources: the refusal names the
    enabled ones (not the disabled ceph.sources) and the no-subscription repository, and changes nothing."""
    before = (snapshot(), packages())
    time.sleep(2)  # the lists are older than the 1 s below: the preflight refreshes them
    out = refused("-e", json.dumps({"host_kernel_apt_cache_valid_time": 1}), "--tags", "preflight")
    assert "host lab-host: apt could not refresh its package lists" in out, out[-2000:]
    enabled = (
        "/etc/apt/sources.list.d/proxmox.sources, /etc/apt/sources.list.d/pve-enterprise.sources"
        " enable Proxmox's enterprise repository"
    )
    assert enabled in out and "ceph.sources" not in out, out[-2000:]
    assert "pve-no-subscription repository" in out and "nothing was changed" in out, out[-2000:]
    assert (snapshot(), packages()) == before


def test_a_pin_apt_does_not_have_is_refused_naming_what_it_has(lab_host):
    before = (snapshot(), packages())
    out = refused(
        "-e",
        json.dumps({"host_kernel_version": MISSING, "host_kernel_packages": [f"linux-headers-{MISSING}"]}),
    )
    assert f"host lab-host: apt has no candidate for linux-headers-{MISSING}" in out, out[-2000:]
    # lab-host's pin (inventory/lab) is the bookworm kernel ABI apt has; the refusal must offer it.
    assert "(apt has of the 6.1 series: linux-headers-6.1.0-50-amd64" in out, out[-2000:]
    assert "linux-headers-6.1.0-50-cloud-amd64" not in out, "offers another flavour than -amd64"
    assert "nothing was changed" in out
    assert (snapshot(), packages()) == before


def test_stale_lists_are_refreshed_before_a_pin_is_refused(newer_repository):
    """Lists younger than host_kernel_apt_cache_valid_time are trusted (no update: refused); older ones are
    refreshed first, and then the pin that only the newer lists have passes the preflight."""
    pin = {
        "host_kernel_version": NEWER,
        "host_kernel_packages": [NEWER_PACKAGE],
        "host_kernel_dkms_expected": {},
    }
    sh("touch /var/lib/apt/lists")  # as fresh as an update that ran just now
    out = refused("-e", json.dumps(pin), "--tags", "preflight")
    assert f"apt has no candidate for {NEWER_PACKAGE} (apt has of the 6.1 series: none)" in out, out[-2000:]
    time.sleep(2)
    before = (
        packages()
    )  # the lab's other tests may change DKMS or units meanwhile: the packages are this play's
    proc = playbook(
        L0, "-e", json.dumps({**pin, "host_kernel_apt_cache_valid_time": 1}), "--tags", "preflight"
    )
    assert proc.returncode == 0, " ".join(proc.stdout.split())[-2000:]
    assert "Candidate: 1.0" in sh(f"apt-cache policy {NEWER_PACKAGE}")
    assert packages() == before
