"""Fault injection for L0/L1: ansible-playbook against the lab host with bad input, asserting on the
one-line error and on the host being exactly as before (no DKMS state, source tree, boot or modprobe
configuration changed)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = REPO / ".venv" / "bin"
HOST = "lab-host"


def lab_host_up() -> bool:
    proc = subprocess.run(["lxc-info", "-n", HOST, "-s", "-H"], capture_output=True, text=True, check=False)
    return proc.stdout.strip() == "RUNNING"


def attach(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["lxc-attach", "-n", HOST, "--", *cmd], capture_output=True, text=True, check=False)


def playbook(path: str, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PATH": f"{VENV_BIN}:{os.environ['PATH']}",
        "ANSIBLE_CONFIG": str(REPO / "ansible" / "ansible.cfg"),
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_FORCE_COLOR": "0",
    }
    cmd = [
        str(VENV_BIN / "ansible-playbook"),
        "-i",
        str(REPO / "inventory" / "lab"),
        "--limit",
        HOST,
        path,
        *extra,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, check=False, timeout=900)


# What bad input must never change: DKMS registrations, source trees, the boot and module configuration.
SNAPSHOT = (
    "dkms status 2>/dev/null; ls -1 /usr/src;"
    " ls -1 /etc/modprobe.d /etc/modules-load.d /etc/kernel 2>/dev/null;"
    " cat /etc/kernel/proxmox-boot-pin /etc/kernel/next-boot-pin 2>/dev/null;"
    " ls -1 /lib/modules/*/updates/dkms 2>/dev/null; ls -1 /etc/systemd/system | grep -i nvidia; true"
)


def snapshot() -> str:
    return attach("sh", "-c", SNAPSHOT).stdout


@pytest.fixture(scope="session")
def layer_l0() -> None:
    """L1's refusals are about L1's build: the host first gets L0 (the pinned kernel's headers) and L1's
    build tools (DKMS adds its kernel hooks to /etc/kernel, which the snapshot watches; L1 installs them once
    a source is known good). No-ops when a provision or the host-layers scenario did this already: no test
    depends on the order of the tests or of the suites."""
    if not lab_host_up():
        pytest.skip(f"{HOST} is not running: `make lab` builds it")
    proc = playbook("ansible/l0_host.yml")
    assert proc.returncode == 0, proc.stdout[-3000:]
    defaults = yaml.safe_load((REPO / "roles" / "nvidia_driver" / "defaults" / "main.yml").read_text())
    tools = attach(
        "env",
        "DEBIAN_FRONTEND=noninteractive",
        "apt-get",
        "install",
        "-y",
        "-q",
        "--no-install-recommends",
        *defaults["nvidia_driver_build_packages"],
    )
    assert tools.returncode == 0, f"installing L1's build tools failed: {tools.stderr[-2000:]}"


@pytest.fixture
def lab_host(layer_l0: None):
    return HOST
