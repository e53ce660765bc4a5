"""Real LXC system containers (Debian, systemd as PID 1) standing in for CT 200 and the Proxmox host OS.

Each container is built from a root filesystem (the host's stand-in from a cached minbase tarball, CT 200's
from the CT image: lab/image.py), configured as Proxmox configures a CT (host network here), and marked
complete only once it booted: anything unmarked is a half-built container from an interrupted run, and is
rebuilt rather than trusted.
"""

from __future__ import annotations

import hashlib
import os
import resource
import shutil
import stat
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from lab.errors import LabError
from lab.progress import heartbeat, say
from lab.settings import ContainerSpec, LabSettings

LXC_ROOT = Path("/var/lib/lxc")
# python3 and python3-apt: Ansible's modules; dbus: systemctl talks to PID 1 through it.
BASE_PACKAGES = [
    "systemd",
    "systemd-sysv",
    "dbus",
    "python3",
    "python3-apt",
    "ca-certificates",
    "iproute2",
    "procps",
    "kmod",
    "less",
]
BOOT_TIMEOUT_S = 90
# An unprivileged CT's ids as PVE maps them: CT uid/gid 0..65535 are host 100000..165535 (pve-container
# src/PVE/LXC.pm parse_id_maps: the default `u 0 100000 65536` and `g 0 100000 65536`; /etc/subuid grants
# root:100000:65536).
ID_MAP_BASE = 100000
ID_MAP_SIZE = 65536
SUBID_FILES = (Path("/etc/subuid"), Path("/etc/subgid"))
SYSFS_HOOK = Path(__file__).resolve().parent / "lxc_hooks" / "sysfs"
# Fills a root filesystem directory that does not exist yet: (rootfs, hostname).
RootfsMaker = Callable[[Path, str], None]


def run(
    cmd: list[str], *, check: bool = True, timeout: float | None = None
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    if check and proc.returncode != 0:
        last = (proc.stderr or proc.stdout).strip().splitlines()
        raise LabError(f"`{' '.join(cmd)}` failed: {last[-1] if last else f'exit {proc.returncode}'}")
    return proc


def base_rootfs(settings: LabSettings) -> Path:
    """Cached minbase tarball; written to a temporary name and renamed, so a partial one is never used."""
    tar = settings.lab_dir / "cache" / f"{settings.suite}-base.tar"
    if tar.exists():
        return tar
    tar.parent.mkdir(parents=True, exist_ok=True)
    partial = tar.with_suffix(".partial.tar")
    say(f"lab: building the {settings.suite} root filesystem with mmdebstrap (about 30 s)")
    with heartbeat(f"mmdebstrap {settings.suite} minbase"):
        _mmdebstrap(settings, partial)
    partial.rename(tar)
    return tar


def _mmdebstrap(settings: LabSettings, partial: Path) -> None:
    run(
        [
            "mmdebstrap",
            "--quiet",
            "--variant=minbase",
            f"--include={','.join(BASE_PACKAGES)}",
            settings.suite,
            str(partial),
            settings.mirror,
        ],
        timeout=900,
    )


def minbase_rootfs(settings: LabSettings) -> RootfsMaker:
    """The host's stand-in: the cached minbase tarball, unpacked under a temporary name and renamed."""

    def make(rootfs: Path, hostname: str) -> None:
        tar = base_rootfs(settings)
        partial = rootfs.with_name(rootfs.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        run(["tar", "-xf", str(tar), "-C", str(partial)], timeout=300)
        (partial / "etc" / "hostname").write_text(hostname + "\n")
        partial.rename(rootfs)

    return make


def lxc_config(spec: ContainerSpec, settings: LabSettings) -> str:
    lines = [
        "# Written by `make lab` (lab/containers.py); a real CT 200 gets the same entries from Proxmox.",
        "lxc.include = /usr/share/lxc/config/common.conf",
        f"lxc.uts.name = {spec.name}",
        f"lxc.rootfs.path = dir:{LXC_ROOT / spec.name / 'rootfs'}",
        "lxc.net.0.type = none",  # host network: loopback services (fakepve, S3) are reachable as on the host
        "lxc.apparmor.profile = unconfined",
        f"lxc.prlimit.memlock = {memlock_limit()}",
    ]
    if spec.unprivileged:
        lines += unprivileged_lines()
    else:
        lines.append("lxc.mount.auto = proc:mixed sys:mixed cgroup:mixed")
    if spec.shm_size_mb is not None:
        # The entry Proxmox writes for a sized /dev/shm: tmpfs pages count against the memory limit below.
        lines.append(
            f"lxc.mount.entry = tmpfs dev/shm tmpfs rw,nosuid,nodev,size={spec.shm_size_mb}m,create=dir 0 0"
        )
    if spec.memory_mb is not None:
        # cgroup v1 line: this machine's hybrid layout ignores cgroup2 limit lines.
        lines.append(f"lxc.cgroup.memory.limit_in_bytes = {spec.memory_mb}M")
    for source, target in spec.binds:  # ct: its mount points; host: the shared storage (lab/settings.py)
        lines.append(f"lxc.mount.entry = {source} {target.lstrip('/')} none bind,create=dir 0 0")
    if spec.role == "ct":
        for wheel_dir in settings.wheel_dirs:
            if wheel_dir.is_dir():
                rel = str(wheel_dir).lstrip("/")
                lines.append(f"lxc.mount.entry = {wheel_dir} {rel} none bind,ro,create=dir 0 0")
    return "\n".join(lines) + "\n"


def unprivileged_lines() -> list[str]:
    """What PVE writes for an unprivileged CT (pve-container src/PVE/LXC.pm update_lxc_config: userns.conf,
    the default id maps, sys:mixed), less the sysfs mount that a CT on this machine's network
    namespace cannot make itself: lab/lxc_hooks/sysfs says why and mounts it from outside."""
    return [
        "lxc.include = /usr/share/lxc/config/userns.conf",
        # userns.conf empties common.conf's lxc.cap.drop; the lab drops it again so that systemd skips
        # sys-kernel-debug.mount (ConditionCapability=CAP_SYS_RAWIO): debugfs cannot be mounted in a user
        # namespace, and the boot would end "degraded" instead of "running" (lab/containers.py wait_booted).
        "lxc.cap.drop = mac_admin mac_override sys_time sys_module sys_rawio",
        f"lxc.idmap = u 0 {ID_MAP_BASE} {ID_MAP_SIZE}",
        f"lxc.idmap = g 0 {ID_MAP_BASE} {ID_MAP_SIZE}",
        "lxc.mount.auto =",  # common.conf's sys:mixed would fail (EPERM): reset, then everything but sys
        "lxc.mount.auto = proc:mixed cgroup:mixed",
        f"lxc.hook.pre-start = {SYSFS_HOOK}",
        f"lxc.hook.post-stop = {SYSFS_HOOK}",
    ]


def ensure_subids() -> None:
    """root may map the ids an unprivileged CT uses (newuidmap refuses a range /etc/subuid does not grant):
    the line a PVE host has from its installation."""
    line = f"root:{ID_MAP_BASE}:{ID_MAP_SIZE}"
    for path in SUBID_FILES:
        text = path.read_text() if path.exists() else ""
        if line not in text.splitlines():
            path.write_text(text + ("" if text.endswith("\n") or not text else "\n") + line + "\n")


def shift_ids(rootfs: Path, base: int = ID_MAP_BASE) -> None:
    """Moves every file of a fresh root filesystem to the CT's mapped ids, as `pct create` unpacks a template
    for an unprivileged CT (pve-container src/PVE/LXC/Create.pm restore_archive runs tar through
    lxc-usernsexec with the CT's id map). chown clears set-id bits, so they are put back."""
    for directory, dirs, files in os.walk(rootfs):
        # os.walk lists a symlink to a directory among dirs and does not enter it: it is chowned from here.
        links = [d for d in dirs if os.path.islink(os.path.join(directory, d))]
        for path in [directory, *(os.path.join(directory, f) for f in [*files, *links])]:
            st = os.lstat(path)
            if st.st_uid >= base:
                continue
            os.lchown(path, st.st_uid + base, st.st_gid + base)
            if not stat.S_ISLNK(st.st_mode) and st.st_mode & (stat.S_ISUID | stat.S_ISGID):
                os.chmod(path, stat.S_IMODE(st.st_mode))


def memlock_limit() -> str:
    """CT 200 gets an unlimited memlock (pinned host buffers); a lab machine whose own hard limit is lower
    cannot grant more than it has, so the lab passes that limit on."""
    hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)[1]
    return "unlimited" if hard == resource.RLIM_INFINITY else str(hard)


def state(name: str) -> str:
    proc = run(["lxc-info", "-n", name, "-s", "-H"], check=False)
    return proc.stdout.strip() if proc.returncode == 0 else "ABSENT"


def init_pid(name: str) -> int | None:
    """PID (on this machine) of the container's init, None when it is not running."""
    proc = run(["lxc-info", "-n", name, "-p", "-H"], check=False)
    return int(proc.stdout.strip()) if proc.returncode == 0 and proc.stdout.strip().isdigit() else None


def attach(name: str, *cmd: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return run(["lxc-attach", "-n", name, "--", *cmd], check=False, timeout=timeout)


def systemd_state(name: str) -> str:
    if state(name) != "RUNNING":
        return "not running"
    proc = attach(name, "systemctl", "is-system-running", timeout=10)
    return proc.stdout.strip() or "unknown"


def _marker(name: str) -> Path:
    return LXC_ROOT / name / "lab-complete"


def is_complete(name: str) -> bool:
    """Built, configured and booted once by `make lab` (a container without the marker is half-built)."""
    return _marker(name).exists()


def remove(name: str) -> None:
    """Stops container NAME and removes its directory."""
    if state(name) == "RUNNING":
        run(["lxc-stop", "-n", name, "-k"], check=False, timeout=60)
    if (LXC_ROOT / name).exists():  # never across into a mount left inside (a bind-mounted wheel dir)
        run(["rm", "-rf", "--one-file-system", str(LXC_ROOT / name)], timeout=300)


def wait_booted(name: str, timeout_s: float = BOOT_TIMEOUT_S) -> None:
    """Polls until systemd reports a finished boot; early attaches fail or find no bus: not an error."""
    deadline = time.monotonic() + timeout_s
    status = ""
    last_said = time.monotonic()
    while time.monotonic() < deadline:
        if time.monotonic() - last_said >= 10:
            say(f"lab: {name}: waiting for systemd to finish booting ({status or 'no answer yet'})")
            last_said = time.monotonic()
        status = attach(name, "systemctl", "is-system-running", timeout=10).stdout.strip()
        if status in ("running", "degraded", "maintenance", "stopping"):
            break
        time.sleep(0.5)
    if status != "running":
        failed = attach(name, "systemctl", "--failed", "--no-legend", "--plain").stdout.strip()
        raise LabError(
            f"container {name}: systemd is {status or 'not answering'} after {timeout_s:.0f} s; "
            f"failed units: {failed or 'none'}"
        )


def ensure_container(spec: ContainerSpec, settings: LabSettings, make_rootfs: RootfsMaker) -> bool:
    """Builds (with make_rootfs), repairs, reconfigures and starts one container; True if anything changed."""
    changed = False
    directory = LXC_ROOT / spec.name
    marker = _marker(spec.name)
    config = lxc_config(spec, settings)
    digest = hashlib.sha256(config.encode()).hexdigest()

    if directory.exists() and not marker.exists():
        say(f"lab: {spec.name} is half-built (no completion marker); rebuilding it")
        remove(spec.name)
    if directory.exists() and _rootfs_unprivileged(directory / "rootfs") != spec.unprivileged:
        say(f"lab: {spec.name} changes between privileged and unprivileged; rebuilding it")
        remove(spec.name)
    if not directory.exists():
        directory.mkdir(parents=True)
        make_rootfs(directory / "rootfs", spec.name)
        if spec.unprivileged:
            shift_ids(directory / "rootfs")
        changed = True
    if spec.unprivileged:
        ensure_subids()

    config_path = directory / "config"
    if not config_path.exists() or config_path.read_text() != config:
        config_path.write_text(config)
        if state(spec.name) == "RUNNING":  # a changed config applies at the next start only
            run(["lxc-stop", "-n", spec.name], timeout=120)
        changed = True

    if state(spec.name) != "RUNNING":
        for source, _ in spec.binds:  # lxc-start fails on a missing source
            source.mkdir(parents=True, exist_ok=True)
        settings.log_dir.mkdir(parents=True, exist_ok=True)
        log = settings.log_dir / f"{spec.name}.lxc.log"
        run(["lxc-start", "-n", spec.name, "-d", "-l", "WARN", "-o", str(log)], timeout=60)
        changed = True
    wait_booted(spec.name)
    marker.write_text(digest + "\n")
    return changed


def _rootfs_unprivileged(rootfs: Path) -> bool:
    """Whether ROOTFS was shifted to the mapped ids (its top directory belongs to the CT's root)."""
    try:
        return rootfs.stat().st_uid == ID_MAP_BASE
    except FileNotFoundError:
        return False


def destroy_container(name: str) -> bool:
    if not (LXC_ROOT / name).exists():
        return False
    remove(name)
    return True
