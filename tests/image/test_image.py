"""The CT image, checked inside a throwaway container booted from it: the cpu image (the lab's) in
`make test`, the cuda image in `make test-slow` (built first when missing)."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from testinfra.host import Host

from lab import image
from lab.settings import REPO
from tests.image.lockfile import locks

VENV_PYTHON = "/opt/dflash/venv/bin/python"
# What the trainer imports at run time, by import name.
IMPORTS = ["torch", "transformers", "triton", "fla", "safetensors", "pyarrow", "numpy", "dflash_trainer"]


def variant_lock(built: image.BuiltImage) -> Path:
    return image.LOCKS[built.manifest["variant"]]


def lock_pins(built: image.BuiltImage) -> dict[str, str]:
    return {normal(p.name): p.version for p in locks.read_lock(variant_lock(built)).pins}


def normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_archive_is_a_proxmox_template(built: image.BuiltImage) -> None:
    variant = built.manifest["variant"]
    assert re.fullmatch(rf"debian-12-dflash-{variant}_[^_/]+_amd64\.tar\.zst", built.name), built.name
    assert built.volid == f"local:vztmpl/{built.name}"
    assert hashlib.sha256(built.path.read_bytes()).hexdigest() == built.sha256


def test_systemd_is_pid1_and_running(ct: Host) -> None:
    assert ct.run("cat /proc/1/comm").stdout.strip() == "systemd"
    assert ct.run("systemctl is-system-running").stdout.strip() == "running"


def test_debian_12_with_build_tools_for_triton(ct: Host) -> None:
    assert ct.system_info.distribution == "debian"
    assert ct.system_info.release.startswith("12")
    for pkg in ("gcc", "python3-dev", "python3-apt", "systemd"):
        assert ct.package(pkg).is_installed, pkg
    assert ct.file("/usr/include/python3.11/Python.h").exists


def test_environment_imports_its_packages(ct: Host, built: image.BuiltImage) -> None:
    script = (
        "import importlib, json, sys; print(json.dumps({m: getattr(importlib.import_module(m), "
        "'__version__', '?') for m in sys.argv[1:]}))"
    )
    cmd = ct.run(f'{VENV_PYTHON} -c "{script}" {" ".join(IMPORTS)}')
    assert cmd.rc == 0, cmd.stderr
    versions = json.loads(cmd.stdout.strip().splitlines()[-1])
    pins = lock_pins(built)
    assert versions["torch"].split("+")[0] == pins["torch"]
    assert versions["transformers"] == pins["transformers"]
    assert versions["triton"] == pins["triton"]


def test_torch_is_the_variants_build(ct: Host, built: image.BuiltImage) -> None:
    """cpu: no CUDA in torch; cuda: PyPI's CUDA build with its libraries loadable (no GPU needed for that)."""
    code = "import torch; print(torch.version.cuda); import torch.cuda.nccl as n; print(n.version())"
    cmd = ct.run(f'{VENV_PYTHON} -c "{code}"')
    cuda = cmd.stdout.split()[0] if cmd.stdout else ""
    if built.manifest["variant"] == "cpu":
        assert cuda == "None", f"the cpu image's torch is built for CUDA {cuda}"
    else:
        assert cmd.rc == 0, cmd.stderr
        assert cuda.split(".")[0] == "13", f"the cuda image's torch says CUDA {cuda}"


def test_pip_freeze_is_the_lock(ct: Host, built: image.BuiltImage) -> None:
    """Exactly the lock (setuptools included) plus the trainer; pip itself is the venv's own."""
    freeze = ct.check_output(f"{VENV_PYTHON} -m pip freeze --all --exclude pip")
    lines = [line.split("==", 1) for line in freeze.splitlines()]
    assert all(len(pair) == 2 for pair in lines), f"not all pinned by version: {freeze}"
    installed = {normal(name): version.split("+")[0] for name, version in lines}
    manifest = json.loads(ct.file("/etc/dflash/image.json").content_string)
    expected = lock_pins(built) | {"dflash-trainer": manifest["trainer_version"]}
    assert installed == expected


def test_dflash_train_version(ct: Host) -> None:
    manifest = json.loads(ct.file("/etc/dflash/image.json").content_string)
    assert ct.check_output("dflash-train --version").strip() == f"dflash-train {manifest['trainer_version']}"


def test_manifest_matches_the_lock_and_pins(ct: Host, built: image.BuiltImage) -> None:
    manifest = json.loads(ct.file("/etc/dflash/image.json").content_string)
    assert manifest == built.manifest
    lock = variant_lock(built).read_bytes()
    assert manifest["lock_sha256"] == hashlib.sha256(lock).hexdigest(), "image built from another lock"
    pins = [
        line
        for line in (REPO / "image" / "packages.txt").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    assert {f"{k}={v}" for k, v in manifest["debian_packages"].items()} == set(pins)
    dpkg = ct.check_output("dpkg-query -W -f '${Package}=${Version}\\n'").splitlines()
    assert set(dpkg) == set(pins)


def test_venv_laid_out_as_the_l3_role_expects(ct: Host, built: image.BuiltImage) -> None:
    """roles/ct_environment finds the image's venv stamped complete and keeps it."""
    lock_sha = hashlib.sha256(variant_lock(built).read_bytes()).hexdigest()
    venv = f"/opt/dflash/venvs/{lock_sha[:16]}"
    assert ct.file("/opt/dflash/venv").linked_to == venv
    assert ct.file(f"{venv}/.dflash-lock.sha256").content_string.strip() == lock_sha


def test_no_build_leftovers(ct: Host) -> None:
    assert not ct.file("/tmp/dflash-build").exists
    assert not ct.file("/etc/apt/preferences.d/dflash-pins.pref").exists
    assert ct.run("ls /var/cache/apt/archives/*.deb").rc != 0


UNITS = ["dflash-stage-model.service", "dflash-train.service"]  # image/units.yml


def test_units_present_and_left_to_the_roles(ct: Host, built: image.BuiltImage) -> None:
    """Vendor units from the roles' templates, known to systemd, not enabled (L4/L5 enable theirs)."""
    assert built.manifest["units"] == UNITS
    for unit in UNITS:
        assert ct.file(f"/usr/lib/systemd/system/{unit}").exists, unit
        assert ct.run(f"systemctl cat {unit}").rc == 0, unit
        assert ct.run(f"systemctl is-enabled {unit}").stdout.strip() == "disabled", unit
    stage_tool = ct.file("/usr/local/sbin/dflash-stage-model")
    assert stage_tool.exists and stage_tool.mode & 0o111, "the staging unit's tool is missing"
    assert (
        "ExecStart=/usr/local/sbin/dflash-stage-model "
        in ct.file("/usr/lib/systemd/system/dflash-stage-model.service").content_string
    )


def test_template_unpacks_as_pct_does(built: image.BuiltImage, tmp_path: Path) -> None:
    """The archive holds ./etc/debian_version, which `pct create` reads to pick the OS type."""
    rootfs = tmp_path / "rootfs"
    image.rootfs_from_image(built.path, rootfs, "probe")
    assert (rootfs / "etc" / "debian_version").read_text().startswith("12.")
    assert (rootfs / "etc" / "hostname").read_text() == "probe\n"
