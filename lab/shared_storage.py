"""The lab's shared storage: lab/nfs_standin.py serving lab_dir/shared-storage.export at
lab_dir/shared-storage (LabSettings.shared_storage_dir), which lab-host binds at lab_shared_storage_host_path
and the CTs bind as their mount points. It must be mounted before a container that binds it starts: a bind
made earlier holds the plain directory underneath, or a dead mount, for the life of the container.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from lab import containers
from lab.errors import LabError
from lab.nfs_standin import FSTYPE
from lab.settings import REPO, LabSettings

START_TIMEOUT_S = 15
SIGNATURE = "lab.nfs_standin"


def export_dir(settings: LabSettings) -> Path:
    return settings.lab_dir / "shared-storage.export"


def _pidfile(settings: LabSettings) -> Path:
    return settings.run_dir / "nfs.pid"


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


def our_pid(settings: LabSettings) -> int | None:
    try:
        pid = int(_pidfile(settings).read_text())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError):
        return None
    return pid if SIGNATURE.encode() in cmdline else None


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
    if answering(mount) and our_pid(settings) is not None:
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
    settings.run_dir.mkdir(parents=True, exist_ok=True)
    settings.log_dir.mkdir(parents=True, exist_ok=True)
    log_path = settings.log_dir / "nfs.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", SIGNATURE, str(export_dir(settings)), str(mount)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            start_new_session=True,
        )
    _pidfile(settings).write_text(f"{proc.pid}\n")
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline and proc.poll() is None and not answering(mount):
        time.sleep(0.2)
    if not answering(mount):
        tail = log_path.read_text(errors="replace").strip().splitlines()[-1:] or ["(empty log)"]
        stop(settings)
        raise LabError(f"shared storage: {mount} not mounted in {START_TIMEOUT_S} s; {log_path}: {tail[0]}")
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
    pid = our_pid(settings)
    _pidfile(settings).unlink(missing_ok=True)
    if pid is not None:
        os.killpg(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        if Path(f"/proc/{pid}").exists():
            os.killpg(pid, signal.SIGKILL)
    return was or pid is not None
