"""L1 driver: NVIDIA open modules built by DKMS for the pinned kernel, nouveau blacklisted, the
boot units in place, and on hosts with GPUs: every GPU in nvidia-smi, persistence on, device nodes,
module and userspace versions equal.
Runbook for a failed check: docs/host-layers.md."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

GROUP = "proxmox_hosts"
DEFAULTS = yaml.safe_load(
    (Path(__file__).resolve().parents[2] / "roles/nvidia_driver/defaults/main.yml").read_text()
)


def var(hostvars: dict[str, Any], name: str) -> Any:
    value = hostvars.get(name, DEFAULTS.get(name))
    if value is None or "{{" in str(value):
        pytest.fail(f"{name} is not set to a plain value in the inventory")
    return value


def kernel(hostvars: dict[str, Any]) -> str:
    return str(hostvars.get("nvidia_driver_kernel_version") or var(hostvars, "host_kernel_version"))


def gpu_count(hostvars: dict[str, Any]) -> int:
    return int(hostvars.get("host_gpu_count", 0))


def proxmox_host(host) -> bool:
    return host.file("/usr/sbin/proxmox-boot-tool").exists and host.file("/usr/bin/pveversion").exists


def needs_gpus(host, hostvars: dict[str, Any]) -> int:
    """The GPU count for checks that need the driver loaded. On a Proxmox host they run (and fail there when
    the pinned kernel does not run); the lab host runs this machine's kernel, for which L1 builds no module,
    so the driver cannot answer there: skipped, saying so."""
    count = gpu_count(hostvars)
    if count == 0:
        pytest.skip("no GPUs in the inventory (host_gpu_count is 0)")
    running = host.check_output("uname -r")
    if running != kernel(hostvars) and not proxmox_host(host):
        pytest.skip(
            f"not a Proxmox host and running {running}, not the pinned {kernel(hostvars)}: no NVIDIA module"
            " for the running kernel, no driver answers"
            " (tests/l0_l1_host/test_userspace.py imitates the boot)"
        )
    return count


def test_kernel_pinned_and_running(host, hostvars):
    if not proxmox_host(host):
        pytest.skip("not a Proxmox host (no proxmox-boot-tool): the lab host runs this machine's kernel")
    version = kernel(hostvars)
    assert host.check_output("uname -r") == version, f"running {host.check_output('uname -r')}, not {version}"
    pin = host.file("/etc/kernel/proxmox-boot-pin")
    assert pin.exists and pin.content_string.strip() == version, (
        f"{version} runs but is not pinned permanently"
    )


def test_dkms_module_installed_for_pinned_kernel(host, hostvars):
    name, version = var(hostvars, "nvidia_driver_dkms_name"), str(var(hostvars, "nvidia_driver_version"))
    status = host.check_output("dkms status -m %s -v %s -k %s", name, version, kernel(hostvars))
    assert status.endswith(": installed"), f"dkms status for {kernel(hostvars)}: {status or 'nothing'}"


def test_module_version_for_pinned_kernel(host, hostvars):
    version = str(var(hostvars, "nvidia_driver_version"))
    found = host.run("modinfo -k %s -F version nvidia", kernel(hostvars))
    assert found.rc == 0, f"no nvidia module for kernel {kernel(hostvars)}"
    assert found.stdout.strip() == version, (
        f"nvidia module {found.stdout.strip()} for {kernel(hostvars)}, not {version}"
    )


def test_nouveau_blacklisted(host, hostvars):
    path = var(hostvars, "nvidia_driver_blacklist_file")
    lines = host.file(path).content_string.splitlines()
    for module in ("nouveau", "nova_core", "nova_drm"):  # each binds NVIDIA GPUs before nvidia.ko can
        assert f"blacklist {module}" in lines, f"{path} does not blacklist {module}"
    if host.run("systemd-detect-virt --container").rc != 0:
        for module in ("nouveau", "nova_core"):
            assert not host.file(f"/sys/module/{module}").exists, f"{module} is loaded"


def test_boot_units_enabled(host, hostvars):
    assert host.service("nvidia-device-nodes.service").is_enabled, (
        "nvidia-device-nodes.service (/dev/nvidia-uvm) not enabled"
    )
    if hostvars.get("nvidia_driver_persistenced", True):
        assert host.service("nvidia-persistenced.service").is_enabled, (
            "nvidia-persistenced.service not enabled"
        )


def test_every_gpu_in_nvidia_smi(host, hostvars):
    count = needs_gpus(host, hostvars)
    gpus = host.check_output("nvidia-smi --query-gpu=index,pci.bus_id --format=csv,noheader").splitlines()
    assert len(gpus) == count, f"nvidia-smi shows {len(gpus)} GPU(s), host_gpu_count is {count}: {gpus}"


def test_persistence_mode_on(host, hostvars):
    needs_gpus(host, hostvars)
    rows = host.check_output(
        "nvidia-smi --query-gpu=index,persistence_mode --format=csv,noheader"
    ).splitlines()
    off = [row for row in rows if not row.endswith("Enabled")]
    assert not off, f"persistence mode off on GPU(s): {off}"


def test_device_nodes_present(host, hostvars):
    count = needs_gpus(host, hostvars)
    nodes = [
        "/dev/nvidiactl",
        "/dev/nvidia-uvm",
        "/dev/nvidia-uvm-tools",
        *(f"/dev/nvidia{i}" for i in range(count)),
    ]
    missing = [node for node in nodes if not host.file(node).is_character_device]
    assert not missing, f"device nodes missing: {missing}"


def test_module_and_userspace_versions_equal(host, hostvars):
    needs_gpus(host, hostvars)
    version = str(var(hostvars, "nvidia_driver_version"))
    module = host.file("/sys/module/nvidia/version").content_string.strip()
    userspace = set(
        host.check_output("nvidia-smi --query-gpu=driver_version --format=csv,noheader").splitlines()
    )
    assert module == version, f"loaded nvidia module is {module}, not {version}"
    assert userspace == {version}, f"nvidia-smi reports driver {sorted(userspace)}, module {module}"
