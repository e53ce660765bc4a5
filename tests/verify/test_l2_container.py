"""L2 container: CT 200 runs with the limits the inventory gives it (checked from inside the container).

Runs against any inventory (`make verify INVENTORY=...`); device checks are skipped where ct_gpus is empty.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

GROUP = "training_cts"
PVE_DEFAULTS = yaml.safe_load(
    (Path(__file__).resolve().parents[2] / "roles/pve_container/defaults/main.yml").read_text()
)


def plain(hostvars: dict[str, Any], key: str) -> Any:
    """An inventory value as written, or None when it is a template the inventory alone cannot render."""
    value = hostvars.get(key)
    return None if isinstance(value, str) and "{{" in value else value


def test_container_runs_systemd(host) -> None:
    """Booted: running or degraded, or still starting where every job that runs is the training's own (the
    model's staging and the trainer until READY run at every boot and hold multi-user.target: L2's boot wait,
    roles/pve_container/tasks/start.yml)."""
    assert host.run("cat /proc/1/comm").stdout.strip() == "systemd"
    state = host.run("systemctl is-system-running").stdout.strip()
    if state == "starting":
        jobs = [
            line.split() for line in host.run("systemctl list-jobs --no-legend --plain").stdout.splitlines()
        ]
        others = [
            job[1]
            for job in jobs
            if len(job) >= 4 and job[3] == "running" and not job[1].startswith("dflash-")
        ]
        assert not others, f"systemd in the CT is still starting: {', '.join(others)} running"
    else:
        assert state in ("running", "degraded"), f"systemd in the CT is {state!r}"


def test_dev_shm_is_a_tmpfs_of_the_inventory_size(host, hostvars: dict[str, Any]) -> None:
    shm = host.mount_point("/dev/shm")
    assert shm.filesystem == "tmpfs", f"/dev/shm is {shm.filesystem}, not tmpfs"
    want_kib = int(hostvars["ct_shm_size_mb"]) * 1024
    sizes = [o for o in shm.options if o.startswith("size=")]
    assert f"size={want_kib}k" in shm.options, (
        f"/dev/shm {sizes or 'has no size'}, inventory wants {want_kib}k"
    )


def test_proxmox_config_carries_the_roles_shm_and_memlock_lines(hostvars: dict[str, Any], proxmox) -> None:
    """The lines the L2 role writes into the CT's config on its Proxmox host (PVE mounts /dev/shm only for
    non-init entry points, so the sized tmpfs is a raw lxc.mount.entry). In the lab the CT itself runs from
    the lab's own config, so the mount checks above cannot see a wrong or missing role line: this reads it."""
    conf_dir = plain(hostvars, "ct_pve_conf_dir") or PVE_DEFAULTS["ct_pve_conf_dir"]
    path = f"{conf_dir}/{hostvars['ct_vmid']}.conf"
    conf = proxmox.file(path)
    assert conf.exists, f"{path} is missing on {hostvars.get('ct_proxmox_host')}"
    lines = conf.content_string.splitlines()
    size = f"size={hostvars['ct_shm_size_mb']}m"
    want_shm = f"lxc.mount.entry: tmpfs dev/shm tmpfs rw,nosuid,nodev,{size},create=dir 0 0"
    shm = [ln for ln in lines if ln.startswith("lxc.mount.entry: tmpfs dev/shm ")]
    assert shm == [want_shm], f"{path}: /dev/shm lines {shm}, the inventory wants [{want_shm!r}]"
    memlock = plain(hostvars, "ct_memlock")
    if memlock is not None:
        found = [ln for ln in lines if ln.startswith("lxc.prlimit.memlock: ")]
        assert found == [f"lxc.prlimit.memlock: {memlock}"], f"{path}: memlock lines {found}, want {memlock}"


def ct_memory_limit(host, proxmox, vmid: object) -> tuple[str, str]:
    """The CT's memory limit and where it was read. PVE sets it on the CT's cgroup lxc/<vmid> and runs the
    CT's processes in its child lxc/<vmid>/ns (pve-container src/PVE/LXC.pm: lxc.cgroup.dir.container and
    .container.inner = ns; liblxc cgfsng.c writes cgroup2 limits to the outer one), so inside the CT
    cgroup v2's memory.max reads "max": the limit is read on the Proxmox host. The lab's machine is hybrid
    (cgroup v1 memory controller, no .inner): there the CT's own memory.limit_in_bytes holds it."""
    on_host = f"/sys/fs/cgroup/lxc/{vmid}/memory.max"
    if proxmox.file(on_host).exists:
        return proxmox.file(on_host).content_string.strip(), f"{on_host} on the Proxmox host"
    v1 = "/sys/fs/cgroup/memory/memory.limit_in_bytes"
    if host.file(v1).exists:
        return host.file(v1).content_string.strip(), f"{v1} in the CT"
    pytest.fail(f"no memory limit found: {on_host} is missing on the Proxmox host (is the CT running?)")


def test_memory_limit_covers_shm_and_trainer(host, proxmox, hostvars: dict[str, Any]) -> None:
    out, where = ct_memory_limit(host, proxmox, hostvars["ct_vmid"])
    want = int(hostvars["ct_memory_mb"]) * 1024 * 1024
    assert out != "max", f"the CT has no memory limit ({where}: max); inventory wants {want} bytes"
    assert int(out) == want, (
        f"memory limit {int(out) // 2**20} MiB, inventory wants {hostvars['ct_memory_mb']} MiB"
    )
    need = int(hostvars["ct_shm_size_mb"]) + int(hostvars.get("ct_trainer_memory_mb", 0))
    assert int(hostvars["ct_memory_mb"]) >= need, (
        "ct_memory_mb is below ct_shm_size_mb + ct_trainer_memory_mb"
    )


def test_memlock_limit(host, hostvars: dict[str, Any]) -> None:
    line = next(
        (
            ln
            for ln in host.file("/proc/1/limits").content_string.splitlines()
            if ln.startswith("Max locked memory")
        ),
        "",
    )
    soft, hard = re.split(r"\s{2,}", line.strip())[1:3]
    assert soft == hard, f"PID 1 memlock soft {soft} differs from hard {hard}"
    want = plain(hostvars, "ct_memlock")
    if want is not None:
        assert soft == str(want), f"memlock is {soft}, inventory wants {want}"


def test_gpu_device_nodes_passed_through(host, gpus: list[int]) -> None:
    for path in [f"/dev/nvidia{g}" for g in gpus] + [
        "/dev/nvidiactl",
        "/dev/nvidia-uvm",
        "/dev/nvidia-uvm-tools",
    ]:
        assert host.file(path).exists, f"{path} is missing in the CT"
        assert host.run(f"test -c {path}").rc == 0, f"{path} is not a character device in the CT"
        # Opening it proves the cgroup allows it (a listed but denied node fails with EPERM).
        assert host.run(f"head -c0 {path}").rc == 0, (
            f"{path} cannot be opened in the CT (cgroup device rule?)"
        )


def test_no_unexpected_gpu_nodes(host, gpus: list[int]) -> None:
    present = host.run("ls /dev | grep -E '^nvidia[0-9]+$' || true").stdout.split()
    extra = sorted(set(present) - {f"nvidia{g}" for g in gpus})
    assert not extra, f"GPU nodes not in ct_gpus are visible in the CT: {extra}"


def test_created_from_the_ct_image_of_its_variant(host, hostvars: dict[str, Any]) -> None:
    """CT 200's root filesystem is the CT image (make image), of the variant the inventory asks for."""
    manifest = host.file("/etc/dflash/image.json")
    assert manifest.exists, "/etc/dflash/image.json is missing: the CT was not created from the CT image"
    built = json.loads(manifest.content_string)
    want = plain(hostvars, "ct_variant") or "cuda"
    assert built.get("variant") == want, (
        f"the CT runs the {built.get('variant')} image, inventory wants {want}"
    )


def test_mount_points_are_in_the_pve_config_and_mounted(host, hostvars: dict[str, Any], proxmox) -> None:
    """ct_mount_points (a multi-node job's shared storage): an mpN entry of the CT (`pct config` on its host)
    and a mount at that path inside the CT."""
    wanted = plain(hostvars, "ct_mount_points") or []
    if not wanted:
        pytest.skip("ct_mount_points is empty for this CT")
    config = proxmox.run(f"pct config {hostvars['ct_vmid']}")
    assert config.rc == 0, (
        f"pct config {hostvars['ct_vmid']} on {hostvars['ct_proxmox_host']}: {config.stderr}"
    )
    entries = re.findall(r"^mp\d+: (.*)$", config.stdout, re.MULTILINE)
    for mp in wanted:
        binds = [
            e for e in entries if e.split(",")[0] == mp["host_path"] and f"mp={mp['path']}" in e.split(",")
        ]
        assert binds, (
            f"CT {hostvars['ct_vmid']} has no mpN {mp['host_path']},mp={mp['path']} (it has {entries})"
        )
        mount = host.mount_point(mp["path"])
        assert mount.exists, f"{mp['path']} is not a mount point in the CT"
        # From the mount's options, not `test -w` as root: on NFS the CT's root is a plain user (host uid
        # 100000) who may not write in the trainer's directory (docs/multi-host.md).
        ro = "ro" in mount.options
        assert ro == bool(mp.get("read_only")), (
            f"{mp['path']} is mounted {'ro' if ro else 'rw'} in the CT ({','.join(mount.options)})"
        )
        if "ct_uid" in mp:
            owner = host.file(mp["path"]).uid
            assert owner == int(mp["ct_uid"]), (
                f"{mp['path']} belongs to uid {owner} in the CT, not its ct_uid {mp['ct_uid']} (L2 chowns "
                "the host side; make provision TAGS=l2)"
            )
