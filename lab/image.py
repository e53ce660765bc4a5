"""The CT image in the lab: CT 200's stand-in runs the root filesystem a Proxmox host creates CT 200 from.

`image/build.sh cpu` (`make image VARIANT=cpu`) writes build/image/cpu.json, the build record, beside the
archive. `make lab` creates lab-ct200 from the latest finished cpu build whose lock and Debian pins are the
tree's (building one when there is none), keeps a link to that archive and a copy of its record under lab_dir
(the L2 role uploads exactly that archive: `ct_image_record`), and unpacks it as Proxmox does for a template.
tests/image boots throwaway containers from the same archive.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

from lab import containers
from lab.errors import LabError
from lab.progress import heartbeat, say
from lab.settings import REPO, LabSettings

BUILD_DIR = REPO / "build" / "image"
BUILD_SCRIPT = REPO / "image" / "build.sh"
BUILD_TIMEOUT_S = 3600
# The lock each variant installs (image/build.sh, roles/ct_environment pick the same): the cuda one adds the
# CUDA libraries of torch's CUDA build (scripts/cuda_lock.py).
LOCKS = {
    "cpu": REPO / "trainer" / "requirements.lock",
    "cuda": REPO / "trainer" / "requirements-cuda.lock",
}
PINS = REPO / "image" / "packages.txt"

# `make lab` makes its containers side by side (lab/cli.py): the first that needs the image builds it and the
# others wait for that build (image/build.sh refuses a second concurrent build of the same cache).
_BUILDING = threading.Lock()
_KEEPING = threading.Lock()

# What image/build.sh's publish step writes and the readers (this module, the L2 role) rely on.
RECORD_KEYS = ["path", "name", "volid", "sha256", "size_bytes", "manifest"]


@dataclass(frozen=True)
class BuiltImage:
    record: dict  # the build record (build/image/VARIANT.json): path, name, volid, sha256, sizes, manifest

    @property
    def path(self) -> Path:  # the .tar.zst
        return Path(self.record["path"])

    @property
    def name(self) -> str:  # its file name, e.g. debian-12-dflash-cpu_0.1.0-g1234567_amd64.tar.zst
        return self.record["name"]

    @property
    def volid(self) -> str:  # where `make image` says to upload it, e.g. local:vztmpl/NAME
        return self.record["volid"]

    @property
    def sha256(self) -> str:
        return self.record["sha256"]

    @property
    def manifest(self) -> dict:  # /etc/dflash/image.json of the image
        return self.record["manifest"]

    def stale_inputs(self) -> list[str]:
        """The tree's files that decide the environment and that this image was not built from (empty: it is
        the tree's image; the trainer itself the L3 role installs over it)."""
        inputs = {"lock_sha256": LOCKS[self.manifest["variant"]], "packages_txt_sha256": PINS}
        return [
            f"{path.relative_to(REPO)}"
            for key, path in inputs.items()
            if self.manifest.get(key) != hashlib.sha256(path.read_bytes()).hexdigest()
        ]


def read_record(path: Path) -> BuiltImage | None:
    """The build record at PATH, or None when there is none or its archive is gone."""
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except ValueError as err:
        raise LabError(f"{path} is not an image build record ({err}); run `make image`") from err
    missing = [key for key in RECORD_KEYS if key not in record] if isinstance(record, dict) else RECORD_KEYS
    if missing:
        raise LabError(f"{path} is not an image build record (no {', '.join(missing)}); run `make image`")
    image = BuiltImage(record)
    return image if image.path.is_file() else None


def built_image(variant: str = "cpu") -> BuiltImage | None:
    """The latest finished build of VARIANT, or None. A build that failed or is still running left no
    VARIANT.json (it is written last, by rename), so a half-written archive is never picked up."""
    return read_record(BUILD_DIR / f"{variant}.json")


def ensure_image(variant: str = "cpu") -> BuiltImage:
    """The latest finished build of VARIANT when it is the tree's image; otherwise builds one (minutes).
    Thread-safe: callers that find none while one is being built wait for it and take it."""
    with _BUILDING:
        return _ensure_image(variant)


def _ensure_image(variant: str) -> BuiltImage:
    found = built_image(variant)
    stale = found.stale_inputs() if found is not None else []
    if found is not None and not stale:
        return found
    why = "none is built" if found is None else f"{found.name} predates {', '.join(stale)}"
    say(
        f"lab: building the {variant} CT image ({why}): image/build.sh {variant}, minutes; "
        f"log {BUILD_DIR / (variant + '.log')}"
    )
    try:  # its phase lines go to the console as they come; the details to its log
        with heartbeat(
            f"building the {variant} CT image (details: tail -f {BUILD_DIR / (variant + '.log')})"
        ):
            proc = subprocess.run([str(BUILD_SCRIPT), variant], timeout=BUILD_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as err:
        raise LabError(f"image/build.sh {variant} ran past {BUILD_TIMEOUT_S} s") from err
    if proc.returncode != 0:
        raise LabError(f"image/build.sh {variant} failed (exit {proc.returncode}), see above")
    found = built_image(variant)
    if found is None or found.stale_inputs():
        raise LabError(f"image/build.sh {variant} succeeded but wrote no record of the tree's image")
    return found


def rootfs_from_image(archive: Path, rootfs: Path, hostname: str) -> None:
    """Unpacks a CT template into ROOTFS (which must not exist) as `pct create` does, then writes what
    Proxmox writes into a new CT: the hostname and the host's resolver. Unpacks into ROOTFS.partial and
    renames, so an interrupted unpack is never mistaken for a root filesystem."""
    if rootfs.exists():
        raise LabError(f"{rootfs} exists already; remove it first")
    partial = rootfs.with_name(rootfs.name + ".partial")
    if partial.exists():
        containers.run(["rm", "-rf", "--one-file-system", str(partial)], timeout=300)
    partial.mkdir(parents=True)
    with heartbeat(f"unpacking {archive.name} for {hostname}"):
        _unpack(archive, partial)
    (partial / "etc" / "hostname").write_text(hostname + "\n")
    resolv = partial / "etc" / "resolv.conf"
    resolv.unlink(missing_ok=True)
    shutil.copyfile("/etc/resolv.conf", resolv)
    partial.rename(rootfs)


def _unpack(archive: Path, partial: Path) -> None:
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


def ct_record_path(settings: LabSettings, name: str) -> Path:
    """Where the lab keeps the record of the image container NAME was made from (the inventory's
    ct_image_record points here)."""
    return settings.lab_dir / "images" / f"{name}.json"


def keep_for_lab(image: BuiltImage, record_path: Path) -> BuiltImage:
    """A link (a copy across file systems) to the archive and a record beside RECORD_PATH pointing at it: what
    the container was made from stays there when build/image moves on, and goes with lab-down.

    Kept by content (a folder per sha256) under the archive's own name, which the L2 role uploads as the
    volid: two builds of one commit share a name but not their bytes (docs/image.md), and a CT made from the
    second must not be recorded against the first's file (its size check refused every CT of the two-CT lab
    made after a rebuild)."""
    kept = record_path.parent / image.sha256[:16] / image.name
    with _KEEPING:  # the CTs of a multi-node lab are made in threads and keep the same archive
        if not (kept.is_file() and kept.stat().st_size == image.record["size_bytes"]):
            kept.parent.mkdir(parents=True, exist_ok=True)
            # A name of this process's own: another `make lab` (or a killed one's leftover) never shares it.
            partial = kept.with_name(f".{image.name}.{os.getpid()}.partial")
            partial.unlink(missing_ok=True)
            try:
                os.link(image.path, partial)
            except OSError:
                shutil.copyfile(image.path, partial)
            os.replace(partial, kept)
    record = {**image.record, "path": str(kept)}
    tmp = record_path.with_name(f".{record_path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, record_path)
    return BuiltImage(record)


def image_rootfs(settings: LabSettings) -> containers.RootfsMaker:
    """CT 200's stand-in: the tree's cpu image (built when missing), kept under lab_dir, then unpacked."""

    def make(rootfs: Path, hostname: str) -> None:
        kept = keep_for_lab(ensure_image("cpu"), ct_record_path(settings, hostname))
        say(f"lab: {hostname} from {kept.name}")
        rootfs_from_image(kept.path, rootfs, hostname)

    return make


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
    containers.wait_booted(name, timeout_s=120)


def destroy(name: str) -> None:
    """Stops and removes container NAME (only ever one this module made: lab- names are refused)."""
    if name.startswith("lab-"):
        raise LabError(f"{name}: refusing to destroy a container of `make lab`")
    containers.remove(name)
