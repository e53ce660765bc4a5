"""The lab's shared storage: lab/nfs_standin.py serving lab_dir/shared-storage.export at
lab_dir/shared-storage (LabSettings.shared_storage_dir), which lab-host binds at lab_shared_storage_host_path
and the CTs bind as their mount points. It must be mounted before a container that binds it starts: a bind
made earlier holds the plain directory underneath, or a dead mount, for the life of the container.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from lab import containers, services
from lab.errors import LabError
from lab.nfs_standin import FSTYPE
from lab.settings import REPO, LabSettings

START_TIMEOUT_S = 15
NAME = "nfs"  # its pid file and log under lab_dir (lab/services.py)
SIGNATURE = "lab.nfs_standin"


def export_dir(settings: LabSettings) -> Path:
    return settings.lab_dir / "shared-storage.export"


def mounted_fstype(path: Path) -> str | None:
    """The file system type mounted exactly at path, None when nothing is."""
    proc = subprocess.run(
        ["findmnt", "--noheadings", "--output", "FSTYPE", "--mountpoint", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    return proc.stdout.strip().splitlines()[-1] if proc.returncode == 0 and proc.stdout.strip() else None


def answering(path: Path) -> bool:
    """Mounted by the stand-in and served (a dead FUSE daemon leaves ENOTCONN behind)."""
    if mounted_fstype(path) != FSTYPE:
        return False
    try:
        os.stat(path)
    except OSError:
        return False
    return True


def _binders(settings: LabSettings) -> list[str]:
    mount = settings.shared_storage_dir
    return [
        spec.name
        for spec in settings.containers
        if any(source == mount or mount in source.parents for source, _ in spec.binds)
    ]


def ensure(settings: LabSettings) -> bool:
    """Mounts the export when it is not served; True when it (re)mounted. Running containers that bind it are
    stopped first (`make lab` starts them again, with binds of the new mount)."""
    mount = settings.shared_storage_dir
    if answering(mount) and services.pid_of(settings, NAME, SIGNATURE) is not None:
        return False
    for name in _binders(settings):
        if containers.state(name) == "RUNNING":
            containers.run(["lxc-stop", "-n", name], timeout=120)
    stop(settings)
    export_dir(settings).mkdir(parents=True, exist_ok=True)
    mount.mkdir(parents=True, exist_ok=True)
    for directory in (export_dir(settings), mount):
        directory.chmod(0o755)  # as a fresh export: host root's, readable by everyone, writable by root only
    if not Path("/dev/fuse").exists():
        raise LabError("shared storage: /dev/fuse is missing (lab/nfs_standin.py, the NFS stand-in, is FUSE)")
    argv = [sys.executable, "-m", SIGNATURE, str(export_dir(settings)), str(mount)]
    proc = services.spawn(settings, NAME, argv, {"PYTHONPATH": str(REPO)})
    services.wait_until(lambda: proc.poll() is not None or answering(mount), START_TIMEOUT_S)
    if not answering(mount):
        stop(settings)
        raise LabError(
            f"shared storage: {mount} not mounted in {START_TIMEOUT_S} s; {services.log_tail(settings, NAME)}"
        )
    return True


def stop(settings: LabSettings) -> bool:
    """Unmounts the export and ends its daemon; True when either was there."""
    mount = settings.shared_storage_dir
    was = mounted_fstype(mount) is not None
    for _ in range(8):  # stacked mounts come off one at a time; lazily: a container's bind keeps one busy
        if mounted_fstype(mount) is None:
            break
        subprocess.run(["umount", "--lazy", str(mount)], capture_output=True, check=False)
    else:
        raise LabError(f"shared storage: {mount} is still mounted after umount ({mounted_fstype(mount)})")
    ended = services.end(settings, NAME, services.pid_of(settings, NAME, SIGNATURE))
    return was or ended
