"""The lab's settings, read from the lab inventory so the lab and the plays share one source of truth."""

from __future__ import annotations

import ipaddress
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from lab.errors import LabError

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class ContainerSpec:
    name: str
    role: str  # "ct" (stands in for CT 200) or "host" (stands in for the Proxmox host OS)
    shm_size_mb: int | None
    memory_mb: int | None
    # Bind mounts: (directory on this machine, absolute path in the container).
    binds: tuple[tuple[Path, str], ...] = ()
    # CT 200 as the inventory's ct_unprivileged says: its root is uid 100000 here (lab/containers.py).
    unprivileged: bool = False


@dataclass(frozen=True)
class LabSettings:
    inventory: Path
    lab_dir: Path
    suite: str
    mirror: str
    fakepve_host: str
    fakepve_port: int
    s3_host: str
    s3_port: int
    s3_bucket: str
    seed: int
    wheel_dirs: tuple[Path, ...]
    containers: tuple[ContainerSpec, ...]

    @property
    def shared_storage_dir(self) -> Path:
        """The lab's NFS export as mounted on this machine (lab/shared_storage.py: a FUSE mount with NFS's
        permission rules), bound on the host's stand-in at lab_shared_storage_host_path as PVE mounts a shared
        storage at /mnt/pve/NAME."""
        return shared_storage_dir(self.lab_dir)

    @property
    def secrets_dir(self) -> Path:
        return self.lab_dir / "secrets"

    @property
    def run_dir(self) -> Path:
        return self.lab_dir / "run"

    @property
    def log_dir(self) -> Path:
        return self.lab_dir / "log"

    @property
    def s3_endpoint(self) -> str:
        return f"http://{self.s3_host}:{self.s3_port}"


def _inventory_json(inventory: Path) -> dict:
    if not inventory.is_dir() and not inventory.is_file():
        raise LabError(f"inventory {inventory}: no such file or directory")
    cmd = [str(Path(sys.executable).parent / "ansible-inventory"), "-i", str(inventory), "--list"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0 or "[WARNING]: Unable to parse" in proc.stderr:
        detail = proc.stderr.strip().splitlines()
        raise LabError(f"inventory {inventory}: cannot be parsed ({detail[-1] if detail else 'no output'})")
    return json.loads(proc.stdout)


def _require(hostvars: dict, key: str, kind: type, inventory: Path):
    if key not in hostvars:
        raise LabError(f"inventory {inventory}: variable {key} is not set")
    value = hostvars[key]
    if kind is int and isinstance(value, str) and value.isdigit():
        value = int(value)
    if not isinstance(value, kind):
        raise LabError(f"inventory {inventory}: {key} must be {kind.__name__}, got {value!r}")
    return value


def shared_storage_dir(lab_dir: Path) -> Path:
    return lab_dir / "shared-storage"


def mount_point_binds(
    host: str, mount_points: object, storage_dir: Path, storage_host_path: str, inventory: Path
) -> tuple[tuple[Path, str], ...]:
    """What Proxmox does with a CT's bind mount points (ct_mount_points, set as mpN by roles/pve_container):
    the host directory appears at the CT path. The lab's host is a container beside the CTs, so a host path
    under the shared storage's mount is bound from the storage's directory on this machine."""
    if not isinstance(mount_points, list):
        raise LabError(f"inventory {inventory}: {host}: ct_mount_points must be a list, got {mount_points!r}")
    binds = []
    for mp in mount_points:
        try:
            below = Path(str(mp["host_path"])).relative_to(storage_host_path)
            ok = ".." not in below.parts and str(mp["path"]).startswith("/")
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok:
            raise LabError(
                f"inventory {inventory}: {host}: ct_mount_points entry {mp!r}: the lab binds host paths "
                f"under lab_shared_storage_host_path {storage_host_path} (its shared storage) at absolute CT "
                "paths only"
            )
        binds.append((storage_dir / below, str(mp["path"])))
    return tuple(binds)


def load_settings(inventory: Path) -> LabSettings:
    data = _inventory_json(inventory)
    hostvars: dict[str, dict] = data.get("_meta", {}).get("hostvars", {})
    groups = {name: data.get(name, {}).get("hosts", []) for name in ("proxmox_hosts", "training_cts")}
    if not groups["proxmox_hosts"] or not groups["training_cts"]:
        raise LabError(f"inventory {inventory}: needs hosts in both groups proxmox_hosts and training_cts")
    any_vars = hostvars[groups["training_cts"][0]]

    def get(key: str, kind: type):
        return _require(any_vars, key, kind, inventory)

    lab_dir = Path(get("lab_dir", str))
    storage_host_path = get("lab_shared_storage_host_path", str)
    if not storage_host_path.startswith("/"):
        raise LabError(
            f"inventory {inventory}: lab_shared_storage_host_path must be absolute, got {storage_host_path}"
        )
    storage_dir = shared_storage_dir(lab_dir)
    containers = [
        ContainerSpec(
            name=h, role="host", shm_size_mb=None, memory_mb=None, binds=((storage_dir, storage_host_path),)
        )
        for h in groups["proxmox_hosts"]
    ]
    for h in groups["training_cts"]:
        v = hostvars[h]
        containers.append(
            ContainerSpec(
                name=h,
                role="ct",
                shm_size_mb=_require(v, "ct_shm_size_mb", int, inventory),
                memory_mb=_require(v, "ct_memory_mb", int, inventory),
                binds=mount_point_binds(
                    h, v.get("ct_mount_points", []), storage_dir, storage_host_path, inventory
                ),
                unprivileged=_require(v, "ct_unprivileged", bool, inventory),
            )
        )
    for key in ("lab_fakepve_host", "lab_s3_host"):
        if not ipaddress.ip_address(get(key, str)).is_loopback:
            raise LabError(f"inventory {inventory}: {key} must be a loopback address, got {get(key, str)}")
    return LabSettings(
        inventory=inventory,
        lab_dir=lab_dir,
        suite=get("lab_debian_suite", str),
        mirror=get("lab_debian_mirror", str),
        fakepve_host=get("lab_fakepve_host", str),
        fakepve_port=get("lab_fakepve_port", int),
        s3_host=get("lab_s3_host", str),
        s3_port=get("lab_s3_port", int),
        s3_bucket=get("lab_s3_bucket", str),
        seed=get("lab_seed", int),
        wheel_dirs=tuple(Path(p) for p in get("lab_wheel_dirs", list)),
        containers=tuple(containers),
    )
