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


NVIDIA_STANDIN = REPO / "lab" / "nvidia_standin"
# The imitated GPU machine: its GPU count (the PCI bus the stand-ins read), the nodes and state they make.
GPU_MACHINE_STATE = (
    "/etc/lab-nvidia /dev/nvidiactl /dev/nvidia[0-9]* /dev/nvidia-uvm /dev/nvidia-uvm-tools"
    " /var/run/nvidia-persistenced"
)


def put(dest: str, data: bytes, mode: str = "0755") -> None:
    """Writes a file on the lab host (parents created)."""
    script = f'mkdir -p "$(dirname {dest})" && cat > {dest} && chmod {mode} {dest}'
    proc = subprocess.run(
        ["lxc-attach", "-n", HOST, "--", "sh", "-c", script], input=data, capture_output=True, check=False
    )
    assert proc.returncode == 0, proc.stderr


def install_standin(name: str, dest_dir: str = "/usr/bin") -> str:
    dest = f"{dest_dir}/{name}"
    put(dest, (NVIDIA_STANDIN / name).read_bytes())
    return dest


def running_kernel() -> str:
    return attach("uname", "-r").stdout.strip()


@pytest.fixture
def gpu_machine(lab_host: str):
    """lab-host plays a host with two NVIDIA GPUs on its PCI bus (lab/nvidia_standin reads the count).
    Whether the driver answers still depends on a module for the running kernel, as on the real host."""
    stop = "systemctl stop nvidia-persistenced.service nvidia-device-nodes.service 2>/dev/null; true"
    attach("sh", "-c", f"{stop}; rm -rf {GPU_MACHINE_STATE}")
    put("/etc/lab-nvidia/gpus", b"2\n", "0644")
    yield 2
    attach("sh", "-c", f"{stop}; rm -rf {GPU_MACHINE_STATE}")


@pytest.fixture
def pinned_kernel_runs(lab_host: str, layer_l1: str):
    """The state after the trial boot: the NVIDIA module L1 built exists for the kernel that runs. The lab
    cannot boot 6.1.0-50-amd64, so the built modules are copied under the running kernel's /lib/modules (then
    depmod, as a kernel package would) and removed afterwards. Yields the running kernel."""
    kernel = running_kernel()
    moddir = f"/lib/modules/{kernel}"
    assert attach("test", "-e", moddir).returncode != 0, f"{moddir} exists on {HOST}: not the lab's state"
    built, dest = f"/lib/modules/{layer_l1}/updates/dkms", f"{moddir}/updates/dkms"
    setup = attach("sh", "-ec", f"mkdir -p {dest}; cp {built}/nvidia*.ko* {dest}/; depmod {kernel}")
    assert setup.returncode == 0, setup.stderr
    yield kernel
    attach("rm", "-rf", moddir)


@pytest.fixture(scope="session")
def layer_l0() -> None:
    """L1's refusals are about L1's build: the host first gets L0 (the pinned kernel's headers) and L1's
    build tools (DKMS adds its kernel hooks to /etc/kernel, which the snapshot watches; L1 installs them once
    a source is known good). No-ops when a provision or the l0-l1-host scenario did this already: no test
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


@pytest.fixture(scope="session")
def layer_l1(layer_l0: None) -> str:
    """The lab's L1 build: the NVIDIA module for the pinned kernel (the L1 play runs only when it is missing).
    Returns that kernel."""
    kernel = str(
        yaml.safe_load((REPO / "inventory/lab/group_vars/proxmox_hosts/host_kernel.yml").read_text())[
            "host_kernel_version"
        ]
    )
    if attach("modinfo", "-k", kernel, "-F", "version", "nvidia").returncode != 0:
        proc = playbook("ansible/l1_driver.yml")
        assert proc.returncode == 0, proc.stdout[-3000:]
    return kernel
