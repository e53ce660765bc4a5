"""lab-ct200 is unprivileged, as inventory/example's CT 200 is (ct_unprivileged: true): what a user namespace
enforces on a real host, seen from inside the lab's CT.

Upstream: pve-container src/PVE/LXC.pm parse_id_maps (the default map `u 0 100000 65536`, `g 0 100000 65536`)
and src/PVE/LXC/Create.pm restore_archive (the template is unpacked through the CT's id map); the kernel's
capability checks against an inode's owner (fs/inode.c inode_owner_or_capable, kernel/capability.c
privileged_wrt_inode_uidgid): the CT's root has no privilege over a file whose owner is not mapped into it,
which is why an NFS/CephFS directory owned by the host's root is read-only for it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from lab import containers
from lab.settings import REPO, load_settings

SETTINGS = load_settings(REPO / "inventory" / "lab")
CTS = [c for c in SETTINGS.containers if c.role == "ct"]
NOBODY = 65534  # an unmapped owner as the CT sees it (the kernel's overflow uid)


def ct_sh(name: str, script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["lxc-attach", "-n", name, "--", "sh", "-c", script], capture_output=True, text=True, check=False
    )


@pytest.fixture(scope="module", params=[c.name for c in CTS if c.unprivileged])
def ct(request: pytest.FixtureRequest) -> str:
    if containers.state(request.param) != "RUNNING":
        pytest.skip(f"{request.param} is not running: `make lab` builds it")
    return request.param


def test_the_lab_ct_is_unprivileged_as_the_example_is() -> None:
    assert CTS and all(c.unprivileged for c in CTS), [(c.name, c.unprivileged) for c in CTS]


def test_ct_root_is_host_uid_100000(ct: str) -> None:
    pid = containers.init_pid(ct)
    assert pid is not None
    uid_map = Path(f"/proc/{pid}/uid_map").read_text().split()
    gid_map = Path(f"/proc/{pid}/gid_map").read_text().split()
    assert uid_map == ["0", "100000", "65536"], uid_map
    assert gid_map == ["0", "100000", "65536"], gid_map


def test_a_file_made_by_the_cts_root_belongs_to_uid_100000_on_the_host(ct: str) -> None:
    made = ct_sh(ct, "f=/root/.lab-owner-probe; : > $f; stat -c %u:%g $f")
    assert made.returncode == 0, made.stderr
    assert made.stdout.strip() == "0:0"
    outside = containers.LXC_ROOT / ct / "rootfs" / "root" / ".lab-owner-probe"
    try:
        assert (outside.stat().st_uid, outside.stat().st_gid) == (100000, 100000)
    finally:
        outside.unlink(missing_ok=True)


@pytest.fixture
def host_root_dir(ct: str) -> Iterator[tuple[Path, str]]:
    """A directory owned by this machine's root inside the CT's tree: what a bind mount of an NFS export or a
    PVE storage owned by the host's root looks like from the CT."""
    outside = containers.LXC_ROOT / ct / "rootfs" / "tmp" / "lab-host-owned"
    shutil.rmtree(outside, ignore_errors=True)
    outside.mkdir(mode=0o755)
    os.chown(outside, 0, 0)
    try:
        yield outside, "/tmp/lab-host-owned"
    finally:
        shutil.rmtree(outside, ignore_errors=True)


def test_a_directory_of_the_hosts_root_is_nobodys_and_not_writable_for_the_cts_root(
    ct: str, host_root_dir: tuple[Path, str]
) -> None:
    outside, inside = host_root_dir
    seen = ct_sh(ct, f"stat -c %u {inside}; touch {inside}/probe")
    owner, *_ = seen.stdout.split()
    assert int(owner) == NOBODY, seen.stdout
    assert seen.returncode != 0 and "Permission denied" in seen.stderr, (seen.returncode, seen.stderr)
    # What roles/pve_container does for a shared checkpoint directory: give it to the CT's mapped root.
    os.chown(outside, 100000, 100000)
    again = ct_sh(ct, f"stat -c %u {inside}; touch {inside}/probe && echo wrote")
    assert again.stdout.split() == ["0", "wrote"], (again.stdout, again.stderr)


def test_the_cts_root_cannot_make_device_nodes(ct: str) -> None:
    """GPU nodes reach an unprivileged CT only as devN entries that PVE creates from outside: mknod inside is
    refused (no CAP_MKNOD over the host's devices)."""
    made = ct_sh(ct, "mknod /tmp/lab-null c 1 3; rc=$?; rm -f /tmp/lab-null; exit $rc")
    assert made.returncode != 0, "mknod succeeded in an unprivileged CT"
    assert "Operation not permitted" in made.stderr, made.stderr
