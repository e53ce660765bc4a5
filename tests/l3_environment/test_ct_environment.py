"""The L3 role's GPU preflight against the lab: a host whose NVIDIA module is too old for the CUDA release of
the cuda lock's torch is refused in seconds, naming the module, the lock and the driver it needs. Only the
preflight runs (`--tags preflight`), so nothing is installed in lab-ct200. The host's module version is read
from a file on lab-host that stands in for /proc/driver/nvidia/version (ct_nvidia_host_version_file)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = REPO / ".venv" / "bin"
HOST, CT = "lab-host", "lab-ct200"
VERSION_FILE = "/root/fake-nvidia-version"
PROC_LINE = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  {version}  Release Build  (dvs@U22)\n"


def lab_up() -> bool:
    states = [
        subprocess.run(["lxc-info", "-n", n, "-s", "-H"], capture_output=True, text=True, check=False).stdout
        for n in (HOST, CT)
    ]
    return all(state.strip() == "RUNNING" for state in states)


pytestmark = pytest.mark.skipif(not lab_up(), reason="needs the lab (make lab)")


SHA256 = "0" * 64  # the preflight checks its form; get_url checks the file against it


def l3_preflight(module_version: str, **more) -> subprocess.CompletedProcess[str]:
    version_file = Path(f"/var/lib/lxc/{HOST}/rootfs{VERSION_FILE}")
    version_file.write_text(PROC_LINE.format(version=module_version))
    extra = {"ct_gpus": [0], "ct_variant": "cuda", "ct_nvidia_host_version_file": VERSION_FILE, **more}
    env = {
        **os.environ,
        "PATH": f"{VENV_BIN}:{os.environ['PATH']}",
        "ANSIBLE_CONFIG": str(REPO / "ansible" / "ansible.cfg"),
        "ANSIBLE_NOCOLOR": "1",
    }
    try:
        return subprocess.run(
            [
                str(VENV_BIN / "ansible-playbook"),
                "-i",
                str(REPO / "inventory" / "lab"),
                "--limit",
                CT,
                "--tags",
                "preflight",
                "-e",
                json.dumps(extra),
                str(REPO / "ansible" / "l3_environment.yml"),
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
            check=False,
        )
    finally:
        version_file.unlink(missing_ok=True)


def test_host_driver_too_old_for_the_locks_cuda_is_refused() -> None:
    run = l3_preflight("550.54.14")
    out = " ".join((run.stdout + run.stderr).split())
    assert run.returncode != 0
    assert "runs NVIDIA kernel module 550.54.14" in out, out[-2000:]
    assert "requirements-cuda.lock is built for CUDA 13, which needs 580.65.06 or newer" in out, out[-2000:]


def test_host_driver_of_the_locks_cuda_passes_the_preflight() -> None:
    run = l3_preflight("580.95.05", ct_nvidia_installer_sha256=SHA256)
    assert run.returncode == 0, (run.stdout + run.stderr)[-2000:]


def test_nvidia_installer_without_a_checksum_is_refused() -> None:
    """The .run runs as root in the CT: without its sha256 it is refused, as L1 refuses the host's."""
    run = l3_preflight("580.95.05")
    out = " ".join((run.stdout + run.stderr).split())
    assert run.returncode != 0
    assert "ct_nvidia_installer_sha256 is not set for NVIDIA-Linux-x86_64-580.95.05.run" in out, out[-2000:]
    assert "a version without a checksum is refused" in out
