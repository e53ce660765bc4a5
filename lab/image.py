"""The CT image in the lab: CT 200's stand-in runs the root filesystem a Proxmox host creates CT 200 from.

`image/build.sh cpu` (`make image VARIANT=cpu`) writes build/image/cpu.json beside the archive; this module
finds that archive, unpacks it as Proxmox does for a template, and boots throwaway containers from it
(tests/image). Without a built image the lab keeps its minbase root filesystem (lab/containers.py).
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

# `from lab import containers`, used at call time: lab/containers.py may import this module in turn.
from lab import containers
from lab.errors import LabError
from lab.settings import REPO

BUILD_DIR = REPO / "build" / "image"
BOOT_TIMEOUT_S = 120


@dataclass(frozen=True)
class BuiltImage:
    path: Path  # the .tar.zst
    name: str  # its file name, e.g. debian-12-dflash-cpu_0.1.0-g1234567_amd64.tar.zst
    volid: str  # where the L2 role uploads it, e.g. local:vztmpl/NAME
    sha256: str
    manifest: dict  # /etc/dflash/image.json of the image

    @property
    def image_id(self) -> str:
        """Changes whenever the archive does: a container built from another image is rebuilt."""
        return f"{self.name}@{self.sha256[:16]}"


def built_image(variant: str = "cpu", build_dir: Path = BUILD_DIR) -> BuiltImage | None:
    """The latest finished build of VARIANT, or None. A build that failed or is still running left no
    VARIANT.json (it is written last, by rename), so a half-written archive is never picked up."""
    info_path = build_dir / f"{variant}.json"
    if not info_path.is_file():
        return None
    try:
        info = json.loads(info_path.read_text())
        image = BuiltImage(Path(info["path"]), info["name"], info["volid"], info["sha256"], info["manifest"])
    except (ValueError, KeyError) as err:
        raise LabError(f"{info_path} is not an image build record ({err}); run `make image`") from err
    if not image.path.is_file():
        return None
    return image


def rootfs_from_image(archive: Path, rootfs: Path, hostname: str) -> None:
    """Unpacks a CT template into ROOTFS (which must not exist) as `pct create` does, then writes what
    Proxmox writes into a new CT: the hostname and the host's resolver. Unpacks into ROOTFS.partial and
    renames, so an interrupted unpack is never mistaken for a root filesystem."""
    if rootfs.exists():
        raise LabError(f"{rootfs} exists already; remove it first")
    partial = rootfs.with_name(rootfs.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    containers.run(
        [
            "tar",
            "--zstd",
            "-xpf",
            str(archive),
            "-C",
            str(partial),
            "--numeric-owner",
            "--xattrs",
            "--xattrs-include=user.*",
            "--xattrs-include=security.capability",
        ],
        timeout=600,
    )
    (partial / "etc" / "hostname").write_text(hostname + "\n")
    resolv = partial / "etc" / "resolv.conf"
    resolv.unlink(missing_ok=True)
    shutil.copyfile("/etc/resolv.conf", resolv)
    partial.rename(rootfs)


def throwaway_config(name: str) -> str:
    """The lab's CT configuration (lab/containers.py), without the sized mounts: enough to boot and check."""
    return (
        "\n".join(
            [
                "# Written by lab/image.py for a throwaway container booted from the CT image.",
                "lxc.include = /usr/share/lxc/config/common.conf",
                f"lxc.uts.name = {name}",
                f"lxc.rootfs.path = dir:{containers.LXC_ROOT / name / 'rootfs'}",
                "lxc.net.0.type = none",
                "lxc.apparmor.profile = unconfined",
                "lxc.mount.auto = proc:mixed sys:mixed cgroup:mixed",
                f"lxc.prlimit.memlock = {containers.memlock_limit()}",
            ]
        )
        + "\n"
    )


def boot_from_image(name: str, archive: Path, log: Path) -> None:
    """Creates container NAME from the archive, starts it and waits for systemd to finish booting."""
    if name.startswith("lab-"):
        raise LabError(f"{name}: names starting with lab- belong to `make lab`; pick another")
    destroy(name)
    directory = containers.LXC_ROOT / name
    rootfs_from_image(archive, directory / "rootfs", name)
    (directory / "config").write_text(throwaway_config(name))
    log.parent.mkdir(parents=True, exist_ok=True)
    containers.run(["lxc-start", "-n", name, "-d", "-l", "WARN", "-o", str(log)], timeout=60)
    wait_booted(name)


def wait_booted(name: str, timeout_s: float = BOOT_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    status = ""
    time.sleep(1)  # the first attach right after lxc-start finds no bus
    while time.monotonic() < deadline:
        status = containers.attach(name, "systemctl", "is-system-running", timeout=10).stdout.strip()
        if status in ("running", "degraded", "maintenance"):
            break
        time.sleep(0.5)
    if status != "running":
        failed = containers.attach(name, "systemctl", "--failed", "--no-legend", "--plain").stdout.strip()
        raise LabError(
            f"container {name}: systemd is {status or 'not answering'} after {timeout_s:.0f} s; "
            f"failed units: {failed or 'none'}"
        )


def destroy(name: str) -> None:
    """Stops and removes container NAME (only ever one this module made: lab- names are refused)."""
    if name.startswith("lab-"):
        raise LabError(f"{name}: refusing to destroy a container of `make lab`")
    if containers.state(name) == "RUNNING":
        containers.run(["lxc-stop", "-n", name, "-k"], check=False, timeout=60)
    directory = containers.LXC_ROOT / name
    if directory.exists():
        containers.run(["rm", "-rf", "--one-file-system", str(directory)], timeout=300)
