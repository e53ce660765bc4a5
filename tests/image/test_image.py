"""The CT image, checked inside a container booted from it (`pytest -m slow tests/image`).

Slow: it boots a container from build/image (and builds the cpu image first when there is none).
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
from testinfra.host import Host

from lab import image
from lab.settings import REPO

pytestmark = pytest.mark.slow

VENV_PYTHON = "/opt/dflash/venv/bin/python"
# What the trainer imports at run time, by import name.
IMPORTS = ["torch", "transformers", "triton", "fla", "safetensors", "pyarrow", "numpy", "dflash_trainer"]


def lock_pins() -> dict[str, str]:
    lines = (REPO / "trainer" / "requirements.lock").read_text().splitlines()
    pins = (line.split("==", 1) for line in lines if "==" in line and not line.startswith("#"))
    return {name.lower().replace("_", "-"): version for name, version in pins}


def normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_archive_is_a_proxmox_template(built: image.BuiltImage) -> None:
    assert re.fullmatch(r"debian-12-dflash-cpu_[^_/]+_amd64\.tar\.zst", built.name), built.name
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


def test_environment_imports_its_packages(ct: Host) -> None:
    script = (
        "import importlib, json, sys; print(json.dumps({m: getattr(importlib.import_module(m), "
        "'__version__', '?') for m in sys.argv[1:]}))"
    )
    cmd = ct.run(f'{VENV_PYTHON} -c "{script}" {" ".join(IMPORTS)}')
    assert cmd.rc == 0, cmd.stderr
    versions = json.loads(cmd.stdout.strip().splitlines()[-1])
    pins = lock_pins()
    assert versions["torch"].split("+")[0] == pins["torch"]
    assert versions["transformers"] == pins["transformers"]
    assert versions["triton"] == pins["triton"]


def test_pip_freeze_is_the_lock(ct: Host) -> None:
    """Exactly the lock plus the trainer (pip freeze leaves out pip and setuptools; the manifest has them)."""
    freeze = ct.check_output(f"{VENV_PYTHON} -m pip freeze")
    lines = [line.split("==", 1) for line in freeze.splitlines()]
    assert all(len(pair) == 2 for pair in lines), f"not all pinned by version: {freeze}"
    installed = {normal(name): version.split("+")[0] for name, version in lines}
    manifest = json.loads(ct.file("/etc/dflash/image.json").content_string)
    expected = {normal(n): v for n, v in lock_pins().items()} | {
        "dflash-trainer": manifest["trainer_version"]
    }
    assert installed == expected


def test_dflash_train_version(ct: Host) -> None:
    manifest = json.loads(ct.file("/etc/dflash/image.json").content_string)
    assert ct.check_output("dflash-train --version").strip() == f"dflash-train {manifest['trainer_version']}"


def test_manifest_matches_the_lock_and_pins(ct: Host, built: image.BuiltImage) -> None:
    manifest = json.loads(ct.file("/etc/dflash/image.json").content_string)
    assert manifest == built.manifest
    lock = (REPO / "trainer" / "requirements.lock").read_bytes()
    assert manifest["lock_sha256"] == hashlib.sha256(lock).hexdigest(), "image built from another lock"
    assert manifest["variant"] == "cpu"
    pins = [
        line
        for line in (REPO / "image" / "packages.txt").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    assert {f"{k}={v}" for k, v in manifest["debian_packages"].items()} == set(pins)
    dpkg = ct.check_output("dpkg-query -W -f '${Package}=${Version}\\n'").splitlines()
    assert set(dpkg) == set(pins)


def test_venv_laid_out_as_the_l3_role_expects(ct: Host) -> None:
    """roles/ct_environment finds the image's venv stamped complete and keeps it."""
    lock_sha = hashlib.sha256((REPO / "trainer" / "requirements.lock").read_bytes()).hexdigest()
    venv = f"/opt/dflash/venvs/{lock_sha[:16]}"
    assert ct.file("/opt/dflash/venv").linked_to == venv
    assert ct.file(f"{venv}/.dflash-lock.sha256").content_string.strip() == lock_sha


def test_no_build_leftovers(ct: Host) -> None:
    assert not ct.file("/tmp/dflash-build").exists
    assert not ct.file("/etc/apt/preferences.d/dflash-pins.pref").exists
    assert ct.run("ls /var/cache/apt/archives/*.deb").rc != 0


def test_units_present_once_roles_ship_them(ct: Host) -> None:
    kinds = (".service", ".timer", ".socket", ".target", ".path")
    units = sorted(p.name for p in REPO.glob("roles/*/files/*") if p.suffix in kinds)
    if not units:
        pytest.skip("no role ships a unit file yet (roles/*/files/*.service)")
    for unit in units:
        assert ct.file(f"/etc/systemd/system/{unit}").exists, unit
        assert ct.run(f"systemctl cat {unit}").rc == 0, unit


def test_template_unpacks_as_pct_does(built: image.BuiltImage, tmp_path: Path) -> None:
    """The archive holds ./etc/debian_version, which `pct create` reads to pick the OS type."""
    rootfs = tmp_path / "rootfs"
    image.rootfs_from_image(built.path, rootfs, "probe")
    assert (rootfs / "etc" / "debian_version").read_text().startswith("12.")
    assert (rootfs / "etc" / "hostname").read_text() == "probe\n"
