"""L1 on a host with GPUs. lab-host plays one (tests/l0_l1_host/conftest.py gpu_machine: two GPUs on its
imitated PCI bus) with lab/nvidia_standin's nvidia-modprobe, nvidia-persistenced and nvidia-smi, which answer
only when an NVIDIA module exists for the RUNNING kernel, as the real ones do.

The first L1 run on a real host happens on its old kernel: DKMS built the module for the pinned kernel only,
so nothing that loads the driver may run before the trial boot. The userspace arrives through the role's
runfile path: a stand-in for NVIDIA's .run installer installs the stand-ins under the real names."""

from __future__ import annotations

import hashlib
import json
import shlex
import subprocess
from collections.abc import Iterator

import pytest

from tests.l0_l1_host.conftest import HOST, NVIDIA_STANDIN, attach, install_standin, playbook

RUNFILE = "/root/lab-nvidia-userspace.run"
USERSPACE = ("nvidia-modprobe", "nvidia-persistenced", "nvidia-smi")
UNITS = ("nvidia-device-nodes.service", "nvidia-persistenced.service")
NODES = ["/dev/nvidiactl", "/dev/nvidia0", "/dev/nvidia1", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]
PINNED_PLAY = "tests/l0_l1_host/l1_pinned_kernel.yml"


def fake_runfile() -> bytes:
    """Stand-in for NVIDIA-Linux-x86_64-VERSION.run: refuses to run without --no-kernel-modules, then installs
    lab/nvidia_standin's programs into /usr/bin as the real installer installs the real ones."""
    lines = [
        "#!/bin/sh",
        "# Stand-in for NVIDIA-Linux-x86_64-VERSION.run (tests/l0_l1_host/test_userspace.py).",
        'case " $* " in',
        '  *" --no-kernel-modules "*) ;;',
        '  *) echo "would install kernel modules: refused" >&2; exit 1 ;;',
        "esac",
    ]
    for name in USERSPACE:
        body = (NVIDIA_STANDIN / name).read_text()
        lines += [
            f"cat > /usr/bin/{name} <<'LAB_EOF'",
            body.rstrip("\n"),
            "LAB_EOF",
            f"chmod 0755 /usr/bin/{name}",
        ]
    return ("\n".join(lines) + "\n").encode()


CLEAN = (
    f"systemctl stop {' '.join(UNITS)} 2>/dev/null;"
    f" rm -f {' '.join('/usr/bin/' + n for n in USERSPACE)} /var/lib/dflash/nvidia-userspace-version"
    f" {RUNFILE} /var/cache/dflash/nvidia/NVIDIA-Linux-x86_64-*.run; true"
)


def active(unit: str) -> str:
    return attach("systemctl", "is-active", unit).stdout.strip()


def nodes_present() -> list[str]:
    return [node for node in NODES if attach("test", "-c", node).returncode == 0]


@pytest.fixture
def runfile_userspace(gpu_machine: int) -> Iterator[dict[str, object]]:
    """The extra vars of an L1 run that installs the stand-in userspace through the role's runfile path."""
    data = fake_runfile()
    attach("sh", "-c", CLEAN)
    put = subprocess.run(
        ["lxc-attach", "-n", HOST, "--", "sh", "-c", f"cat > {RUNFILE}"], input=data, check=False
    )
    assert put.returncode == 0
    yield {
        "host_gpu_count": gpu_machine,
        "nvidia_driver_userspace_method": "runfile",
        "nvidia_driver_userspace_url": f"file://{RUNFILE}",
        "nvidia_driver_userspace_sha256": hashlib.sha256(data).hexdigest(),
    }
    attach("sh", "-c", CLEAN)


@pytest.fixture
def userspace(gpu_machine: int) -> Iterator[int]:
    """The stand-in userspace installed directly (what an earlier L1 run's installer left). The units'
    enablement, which a test may change, is restored afterwards."""
    enabled = {u: attach("systemctl", "is-enabled", u).stdout.strip() == "enabled" for u in UNITS}
    attach("sh", "-c", CLEAN)
    for name in USERSPACE:
        install_standin(name)
    yield gpu_machine
    attach("sh", "-c", CLEAN)
    for unit, was in enabled.items():
        attach("systemctl", "enable" if was else "disable", "--quiet", unit)


def test_standin_fails_without_a_module_for_the_running_kernel(userspace):
    """The stand-ins are as strict as the real programs on the first run (no module for `uname -r`)."""
    modprobe = attach("nvidia-modprobe", "-c=0")
    smi = attach("nvidia-smi")
    assert modprobe.returncode == 1 and not modprobe.stdout + modprobe.stderr, modprobe
    assert smi.returncode == 9, smi
    assert "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver" in smi.stdout
    assert nodes_present() == []


@pytest.mark.slow  # the whole L1 play (a DKMS compile when the lab host has none yet)
def test_first_run_on_the_old_kernel_enables_the_units_and_starts_nothing(runfile_userspace):
    """The first run on a GPU host: the userspace is installed in the same run, the units are enabled for the
    trial boot, and nothing that needs the driver starts on the kernel that still runs."""
    proc = playbook("ansible/l1_driver.yml", "-e", json.dumps(runfile_userspace))
    out = " ".join(proc.stdout.split())
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "start at the trial boot of 6.1.0-50-amd64" in out, out[-2000:]
    enabled = {u: attach("systemctl", "is-enabled", u).stdout.strip() for u in UNITS}
    assert enabled == dict.fromkeys(UNITS, "enabled"), enabled
    assert {u: active(u) for u in UNITS} == dict.fromkeys(UNITS, "inactive")
    assert attach("test", "-x", "/usr/bin/nvidia-modprobe").returncode == 0, "the runfile did not install"


@pytest.mark.parametrize("persistenced", [True, False], ids=["with-persistenced", "without-persistenced"])
def test_on_the_pinned_kernel_the_units_start_and_create_every_node(
    userspace, pinned_kernel_runs, persistenced
):
    """After the trial boot (the pinned kernel runs): the units start, the boot unit alone creates every node
    a CT's devN entries name (persistenced also creates some as a side effect: off in one case), and the
    checks see both GPUs with persistence as configured."""
    extra = {
        "nvidia_driver_kernel_version": pinned_kernel_runs,
        "host_gpu_count": userspace,
        "nvidia_driver_persistenced": persistenced,
    }
    proc = playbook(PINNED_PLAY, "-e", json.dumps(extra))
    nodes = nodes_present()
    states = {u: active(u) for u in UNITS}
    smi = attach(
        "nvidia-smi", "--query-gpu=index,persistence_mode", "--format=csv,noheader"
    ).stdout.splitlines()
    assert nodes == NODES, (
        f"after {shlex.join(['ansible-playbook', PINNED_PLAY])}: nodes {nodes}\n{proc.stdout[-2500:]}"
    )
    assert proc.returncode == 0, proc.stdout[-3000:]
    want_persistenced = "active" if persistenced else "inactive"
    assert states == {UNITS[0]: "active", UNITS[1]: want_persistenced}, states
    mode = "Enabled" if persistenced else "Disabled"
    assert smi == [f"0, {mode}", f"1, {mode}"], smi
