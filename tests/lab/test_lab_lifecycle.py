"""The lab's own life cycle on a twin lab (other container names, ports and lab_dir), so the running lab that
the other checks use is never touched: build, idempotent rebuild, repair of a half-built container, refusal
of a taken port and of bad inventories, and a lab-down that leaves nothing behind."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lab.settings import REPO

# s3_port: not the webhook receiver's fixed 7490 (lab/webhook_receiver.py), which the twin starts too.
TWIN = {"host": "labtwin-host", "ct": "labtwin-ct200", "pve": "127.0.0.3", "s3_port": 7495}


def lab(inventory: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lab", *args, "--inventory", str(inventory)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )


def twin_inventory(root: Path) -> Path:
    inv = root / "inventory"
    shutil.copytree(REPO / "inventory" / "lab", inv)
    hosts = yaml.safe_load((inv / "hosts.yml").read_text())
    children = hosts["all"]["children"]
    children["proxmox_hosts"]["hosts"] = {
        TWIN["host"]: {"ansible_connection": "community.general.lxc", "ansible_host": TWIN["host"]}
    }
    ct_vars = children["training_cts"]["hosts"]["lab-ct200"] | {
        "ansible_host": TWIN["ct"],
        "ct_proxmox_host": TWIN["host"],
    }
    children["training_cts"]["hosts"] = {TWIN["ct"]: ct_vars}
    (inv / "hosts.yml").write_text(yaml.safe_dump(hosts))
    lab_vars = yaml.safe_load((inv / "group_vars/all/lab.yml").read_text())
    lab_vars |= {
        "lab_dir": str(root / "state"),
        "lab_fakepve_host": TWIN["pve"],
        "lab_s3_port": TWIN["s3_port"],
    }
    (inv / "group_vars/all/lab.yml").write_text(yaml.safe_dump(lab_vars))
    return inv


@pytest.fixture(scope="module")
def twin(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("twin")
    inv = twin_inventory(root)
    # The twin shares the main lab's cached root filesystem to save a 30 s mmdebstrap run.
    main_cache = Path("/var/lib/dflash-lab/cache")
    if main_cache.is_dir():
        shutil.copytree(main_cache, root / "state" / "cache")
    yield inv
    lab(inv, "down")


def containers() -> str:
    return subprocess.run(["lxc-ls", "-1"], capture_output=True, text=True, check=False).stdout


def listening(host: str, port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex((host, port)) == 0


@pytest.mark.slow
def test_twin_lab_lifecycle(twin: Path) -> None:
    first = lab(twin, "up")
    assert first.returncode == 0, first.stderr
    assert lab(twin, "status").returncode == 0

    second = lab(twin, "up")
    assert second.returncode == 0, second.stderr
    assert "up, nothing changed" in second.stdout

    # An interrupted build: the completion marker is missing and the root filesystem is incomplete.
    (Path("/var/lib/lxc") / TWIN["ct"] / "lab-complete").unlink()
    repaired = lab(twin, "up")
    assert repaired.returncode == 0, repaired.stderr
    assert f"{TWIN['ct']} is half-built" in repaired.stdout
    assert lab(twin, "status").returncode == 0

    down = lab(twin, "down")
    assert down.returncode == 0, down.stderr
    assert TWIN["host"] not in containers() and TWIN["ct"] not in containers()
    assert not listening(TWIN["pve"], 8006) and not listening("127.0.0.1", TWIN["s3_port"])
    assert not (twin.parent / "state").exists()


def test_taken_port_is_named(twin: Path) -> None:
    with socket.socket() as squatter:
        squatter.bind((TWIN["pve"], 8006))
        squatter.listen()
        proc = lab(twin, "up")
    assert proc.returncode == 1
    assert f"{TWIN['pve']}:8006 is already taken by PID" in proc.stderr
    assert "lab_fakepve_port" in proc.stderr


def test_unknown_inventory_is_named(tmp_path: Path) -> None:
    proc = lab(tmp_path / "nowhere", "up")
    assert proc.returncode == 1
    assert f"inventory {tmp_path / 'nowhere'}: no such file or directory" in proc.stderr


def test_malformed_inventory_is_named(tmp_path: Path) -> None:
    (tmp_path / "hosts.yml").write_text("all:\n  hosts: [\n")
    proc = lab(tmp_path, "status")
    assert proc.returncode == 1
    assert f"inventory {tmp_path}: cannot be parsed" in proc.stderr


def test_non_loopback_service_is_refused(tmp_path: Path) -> None:
    inv = twin_inventory(tmp_path)
    lab_yml = inv / "group_vars/all/lab.yml"
    lab_yml.write_text(
        lab_yml.read_text().replace(f"lab_fakepve_host: {TWIN['pve']}", "lab_fakepve_host: 10.1.2.3")
    )
    proc = lab(inv, "up")
    assert proc.returncode == 1
    assert "lab_fakepve_host must be a loopback address, got 10.1.2.3" in proc.stderr
