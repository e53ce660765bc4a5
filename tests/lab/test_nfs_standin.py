"""The lab's NFS stand-in (lab/nfs_standin.py) mounted for real, with callers as an unprivileged CT makes
them: the CT's root in a user namespace with pve-container's id map, and the trainer's host uid. Beside it,
the plain directory the lab used before, where the CT's root gets through: the stand-in's whole point."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lab.nfs_standin import FSTYPE
from lab.settings import REPO

DFLASH = 102000  # the trainer (uid 2000 in the CT) as a host uid
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounts a FUSE file system: root only")


def as_ct_root(script: str) -> subprocess.CompletedProcess[str]:
    ids = ["--map-users=100000,0,65536", "--map-groups=100000,0,65536", "--setuid", "0", "--setgid", "0"]
    return subprocess.run(["unshare", *ids, "sh", "-c", script], capture_output=True, text=True, check=False)


def as_host_uid(uid: int, script: str, *groups: int) -> subprocess.CompletedProcess[str]:
    group_args = [f"--groups={','.join(map(str, groups))}"] if groups else ["--clear-groups"]
    argv = ["setpriv", f"--reuid={uid}", f"--regid={uid}", *group_args, "sh", "-c", script]
    return subprocess.run(argv, capture_output=True, text=True, check=False)


def open_dir(prefix: str) -> Path:
    """A directory the CT's root can reach (pytest's tmp_path sits in a 0700 directory of host root)."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    path.chmod(0o755)
    return path


def mount(*extra: str) -> Iterator[Path]:
    tmp = open_dir("dflash-nfs-")
    export, point = tmp / "export", tmp / "mnt"
    for d in (export, point):
        d.mkdir(mode=0o755)
    log = open(tmp / "nfs.log", "wb")  # noqa: SIM115 - the daemon writes it for its life
    argv = [sys.executable, "-m", "lab.nfs_standin", str(export), str(point), *extra]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
    findmnt = ["findmnt", "-n", "-o", "FSTYPE", "--mountpoint", str(point)]
    deadline = time.monotonic() + 15
    try:
        while subprocess.run(findmnt, capture_output=True, text=True).stdout.strip() != FSTYPE:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp / "nfs.log").read_text()
            time.sleep(0.2)
        yield point
    finally:
        subprocess.run(["umount", str(point)], check=False)
        proc.wait(timeout=10)
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture
def nfs() -> Iterator[Path]:
    yield from mount()


@pytest.fixture
def squashed() -> Iterator[Path]:
    yield from mount("--root-squash")


def trainer_dir(base: Path) -> Path:
    """What L2 makes of a mount point with ct_uid: 2000: the directory handed to the trainer's host uid."""
    d = base / "shared"
    d.mkdir(mode=0o755)
    os.chown(d, DFLASH, DFLASH)
    return d


def test_the_cts_root_may_write_in_the_trainers_plain_directory_but_not_over_nfs(
    nfs: Path, tmp_path: Path
) -> None:
    plain_base = Path("/tmp") / f"plain-{tmp_path.name}"
    plain_base.mkdir(mode=0o755)
    try:
        plain = trainer_dir(plain_base)
        assert as_ct_root(f"touch {plain}/probe").returncode == 0, "CAP_DAC_OVERRIDE over a mapped owner"
    finally:
        subprocess.run(["rm", "-rf", str(plain_base)], check=False)
    shared = trainer_dir(nfs)
    refused = as_ct_root(f"touch {shared}/probe")
    assert refused.returncode != 0 and "Permission denied" in refused.stderr, refused.stderr
    refused = as_ct_root(f"mkdir {shared}/checkpoints")
    assert refused.returncode != 0 and "Permission denied" in refused.stderr, refused.stderr


def test_the_trainer_writes_renames_and_owns_what_it_makes(nfs: Path) -> None:
    shared = trainer_dir(nfs)
    made = as_host_uid(
        DFLASH, f"mkdir {shared}/ck && echo x > {shared}/ck/a.tmp && mv {shared}/ck/a.tmp {shared}/ck/a"
    )
    assert made.returncode == 0, made.stderr
    a = shared / "ck" / "a"
    assert a.read_text() == "x\n" and (a.stat().st_uid, a.stat().st_gid) == (DFLASH, DFLASH)
    assert ((shared / "ck").stat().st_uid, (shared / "ck").stat().st_mode & 0o777) == (DFLASH, 0o755)


def test_nobody_but_root_gives_a_file_away(nfs: Path) -> None:
    shared = trainer_dir(nfs)
    (shared / "f").write_text("x")
    os.chown(shared / "f", DFLASH, DFLASH)  # host root, no_root_squash: allowed
    by_ct_root = as_ct_root(f"chown 0 {shared}")
    assert by_ct_root.returncode != 0 and "Operation not permitted" in by_ct_root.stderr, by_ct_root.stderr
    by_trainer = as_host_uid(DFLASH, f"chown 100000 {shared}/f")
    assert by_trainer.returncode != 0 and "Operation not permitted" in by_trainer.stderr
    assert (shared / "f").stat().st_uid == DFLASH


def test_a_group_member_writes_through_the_group_bits(nfs: Path) -> None:
    shared = trainer_dir(nfs)
    shared.chmod(0o770)
    assert as_host_uid(103000, f"touch {shared}/g").returncode != 0
    member = as_host_uid(103000, f"touch {shared}/g", DFLASH)
    assert member.returncode == 0, member.stderr


def test_root_squash_refuses_host_roots_chown(squashed: Path) -> None:
    with pytest.raises(PermissionError):
        os.chown(squashed, DFLASH, DFLASH)


def test_a_directory_whose_open_file_was_removed_can_be_removed(nfs: Path) -> None:
    """Without hard_remove, libfuse hides the open file (.fuse_hidden*) and the rmdir is refused: the pruning
    of old checkpoints met that in the two-CT lab."""
    d = nfs / "step"
    d.mkdir()
    with open(d / "state.pt", "w") as f:
        f.write("x")
        os.unlink(d / "state.pt")
        d.rmdir()
    assert not d.exists()
