"""The L2 role (roles/pve_container) for several CTs on several nodes of one cluster, against a private
fakepve with two nodes (docs/multi-host.md): one VMID per CT of a cluster, the job's network interface as
net1, and a shared bind mount owned by the CT's root.

Upstream behaviour the stand-in imitates, and these tests rely on:
- pve-cluster src/PVE/Cluster.pm check_vmid_unused, run by pve-container src/PVE/API2/LXC.pm create_vm: a VMID
  is unique across the cluster ("CT 200 already exists on node 'pve1'"); fakepve 0.5.0's create does the same
  (fakepve/lxc.py _check_vmid_unused), which the first test pins.
- pve-container src/PVE/LXC.pm update_lxc_config: an unprivileged CT gets `lxc.idmap = u 0 100000 65536`, so
  its root is host uid 100000 and a bind-mounted directory owned by host uid 0 is nobody's inside it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.l2_container.conftest import REPO, Run, ansible_playbook

NODES = ("pve1", "pve2")


def two_node_play(tmp_path: Path, lab: dict[str, Any], pve):
    """play(cts, **common) runs ansible/l2_container.yml for several CTs: cts maps an inventory name to its
    host vars (ct_vmid, pve_node ...); each CT's Proxmox host is a local stand-in named after its node (its
    pve_cluster from clusters). devN entries go through the API as root@pam (ct_device_mode api): the lab's
    `pct` stand-in speaks for one node only."""
    for node in NODES:
        if node not in pve.nodes:
            pve.add_node(node)

    def run(
        cts: dict[str, dict[str, Any]],
        groups: dict[str, list[str]] | None = None,
        clusters: dict[str, str] | None = None,
        tags: str = "",
        **common: Any,
    ) -> Run:
        local = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}
        proxmox = {
            f"host-{n}": {**local, **({"pve_cluster": clusters[n]} if clusters else {})} for n in NODES
        }
        hosts = {
            name: {
                **lab,
                "ct_device_mode": "api",
                **common,
                **ct,
                **local,
                "ct_proxmox_host": f"host-{ct['pve_node']}",
            }
            for name, ct in cts.items()
        }
        inventory = {
            "proxmox_hosts": {"hosts": proxmox},
            "training_cts": {"hosts": hosts},
            **{g: {"hosts": {h: {} for h in members}} for g, members in (groups or {}).items()},
        }
        path = tmp_path / "inventory.json"
        path.write_text(json.dumps(inventory))
        tag_args = ["--tags", tags] if tags else []
        return ansible_playbook("-i", str(path), str(REPO / "ansible" / "l2_container.yml"), *tag_args)

    return run


@pytest.fixture
def play2(tmp_path: Path, lab: dict[str, Any], pve):
    return two_node_play(tmp_path, lab, pve)


def changed(run: Run) -> dict[str, int]:
    """changed= of each host in the play's recap."""
    recap = run.out.split("PLAY RECAP")[-1]
    return {
        line.split()[0]: int(line.split("changed=")[1].split()[0])
        for line in recap.splitlines()
        if "changed=" in line
    }


def test_the_api_double_refuses_a_second_ct_200_on_another_node(pve) -> None:
    """What a real cluster answers (check_vmid_unused), so the lab cannot be kinder than the host."""
    pve.add_node("pve2")
    pve.add_ct(200, node="pve1")
    url = f"https://{pve.host}:{pve.port}/api2/json"
    login = {"username": "root@pam", "password": "secret"}
    ticket = requests.post(f"{url}/access/ticket", data=login, verify=False, timeout=10).json()["data"]
    answer = requests.post(
        f"{url}/nodes/pve2/lxc",
        data={"vmid": 200, "ostemplate": "local:vztmpl/x.tar.zst", "storage": "local-lvm"},
        cookies={"PVEAuthCookie": ticket["ticket"]},
        headers={"CSRFPreventionToken": ticket["CSRFPreventionToken"]},
        verify=False,
        timeout=10,
    )
    assert answer.status_code == 500
    assert "CT 200 already exists on node 'pve1'" in answer.reason + answer.text


def test_one_vmid_on_two_nodes_is_refused_before_any_api_call(pve, play2) -> None:
    run = play2({"ct-a": {"pve_node": "pve1", "ct_vmid": 200}, "ct-b": {"pve_node": "pve2", "ct_vmid": 200}})
    assert run.rc != 0
    error = run.error()
    assert "ct_vmid 200 is also the ct_vmid of" in error, error
    assert "VMIDs are unique across a Proxmox cluster" in error
    assert pve.cts == [], f"a CT was created before the refusal: {[(c.vmid, c.node) for c in pve.cts]}"


def test_cts_with_their_own_ids_on_two_nodes_and_a_rerun_changes_nothing(pve, play2) -> None:
    cts = {"ct-a": {"pve_node": "pve1", "ct_vmid": 200}, "ct-b": {"pve_node": "pve2", "ct_vmid": 201}}
    first = play2(cts)
    assert first.rc == 0, first.error()
    assert [(c.vmid, c.node) for c in sorted(pve.cts, key=lambda c: c.vmid)] == [(200, "pve1"), (201, "pve2")]
    again = play2(cts)
    assert again.rc == 0, again.error()
    assert changed(again) == {"ct-a": 0, "ct-b": 0, "host-pve1": 0, "host-pve2": 0}, again.out[-1500:]


def test_hosts_of_separate_clusters_may_reuse_an_id(pve, play2) -> None:
    """pve_cluster on the Proxmox hosts: two clusters, two VMID spaces. One fakepve cannot be two clusters, so
    only the preflight runs here: it lets each CT 200 on to its own cluster's API."""
    cts = {"ct-a": {"pve_node": "pve1", "ct_vmid": 200}, "ct-b": {"pve_node": "pve2", "ct_vmid": 200}}
    same = play2(cts, clusters={"pve1": "gpu-a", "pve2": "gpu-a"}, tags="preflight")
    assert same.rc != 0 and "in Proxmox cluster 'gpu-a'" in same.error(), same.error()
    two = play2(cts, clusters={"pve1": "gpu-a", "pve2": "gpu-b"}, tags="preflight")
    assert two.rc == 0, two.error()


JOB = {"training_job_socket_ifname": "eth1"}


def job_cts(**extra: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Two CTs of one job on the two nodes; extra: more host vars per CT name."""
    cts = {
        "ct-a": {"pve_node": "pve1", "ct_vmid": 200, "training_job_address": "10.30.0.21"},
        "ct-b": {"pve_node": "pve2", "ct_vmid": 201, "training_job_address": "10.30.0.22"},
    }
    return {name: {**ct, **extra.get(name, {})} for name, ct in cts.items()}


def job_nic(address: str) -> dict[str, Any]:
    return {"ct_extra_netifs": [{"name": "eth1", "bridge": "vmbr1", "ip": f"{address}/24"}]}


def test_the_jobs_interface_is_net1_with_a_pinned_mac_and_a_rerun_changes_nothing(pve, play2) -> None:
    cts = job_cts(**{"ct-a": job_nic("10.30.0.21"), "ct-b": job_nic("10.30.0.22")})
    first = play2(cts, groups={"training_job": list(cts)}, **JOB)
    assert first.rc == 0, first.error()
    nets = {ct.vmid: ct.config.get("net1", "") for ct in pve.cts}
    assert all(nets.values()), f"the job's interface is not a netN of the CTs: net1 {nets}"
    for vmid, address in ((200, "10.30.0.21/24"), (201, "10.30.0.22/24")):
        options = dict(part.split("=", 1) for part in nets[vmid].split(","))
        assert options["name"] == "eth1" and options["bridge"] == "vmbr1" and options["ip"] == address, nets
        assert options["hwaddr"].startswith("BC:24:11:") and options.get("firewall") == "1", nets
    macs = {vmid: dict(p.split("=", 1) for p in net.split(","))["hwaddr"] for vmid, net in nets.items()}
    assert macs[200] != macs[201], macs
    again = play2(cts, groups={"training_job": list(cts)}, **JOB)
    assert again.rc == 0, again.error()
    assert changed(again) == {"ct-a": 0, "ct-b": 0, "host-pve1": 0, "host-pve2": 0}, again.out[-1500:]
    assert {ct.vmid: ct.config["net1"] for ct in pve.cts} == nets, (
        "net1 changed on a rerun (an unpinned MAC?)"
    )


def test_a_job_interface_l2_does_not_create_is_refused_before_any_api_call(pve, play2) -> None:
    missing = play2(job_cts(), groups={"training_job": ["ct-a", "ct-b"]}, **JOB)
    assert missing.rc != 0
    error = missing.error()
    assert "training_job_socket_ifname eth1 is not an interface L2 creates (lo, eth0)" in error, error
    assert "add {name: eth1, bridge: BRIDGE, ip: 10.30.0.2" in error and "to ct_extra_netifs" in error
    assert pve.cts == []
    wrong = play2(
        job_cts(**{"ct-a": job_nic("10.30.0.99"), "ct-b": job_nic("10.30.0.22")}),
        groups={"training_job": ["ct-a", "ct-b"]},
        **JOB,
    )
    assert wrong.rc != 0
    assert "given ip=10.30.0.99/24 in ct_extra_netifs, not training_job_address 10.30.0.21" in wrong.error()
    assert pve.ct(200) is None  # ct-a stopped in its preflight (ct-b, right, went on)
    # lo is in every CT (the lab's two CTs, on one machine's network, run their job over it).
    loopback = play2(
        job_cts(),
        groups={"training_job": ["ct-a", "ct-b"]},
        training_job_socket_ifname="lo",
        tags="preflight",
    )
    assert loopback.rc == 0, loopback.error()


def as_ct_root(directory: Path, base: int = 100000) -> subprocess.CompletedProcess[str]:
    """Create and remove a file in directory as root of an unprivileged CT: a user namespace with
    pve-container's map (lxc.idmap u 0 100000 65536, g the same), where root's capabilities reach only files
    of mapped owners."""
    probe = directory / ".ct-root-probe"
    ids = [f"--map-users={base},0,65536", f"--map-groups={base},0,65536", "--setuid", "0", "--setgid", "0"]
    return subprocess.run(
        ["unshare", *ids, "sh", "-c", f"touch {probe} && rm {probe}"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


@pytest.fixture
def open_dir():
    """A directory the CT's root can reach (pytest's tmp_path sits in a 0700 directory of host root), as it
    reaches /mnt/pve/NAME through the bind mount on a host."""
    path = Path(tempfile.mkdtemp(prefix="dflash-multihost-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_shared_storage_is_handed_to_the_unprivileged_cts_root(pve, play2, open_dir: Path) -> None:
    """A shared storage made by host root is nobody's in an unprivileged CT: L2 chowns the host side of the
    mount point to the CT's root (host uid 100000), so the trainer can write its checkpoints there."""
    shared = open_dir / "mnt-pve-dflash-shared"
    shared.mkdir(mode=0o755)
    before = as_ct_root(shared)
    assert before.returncode != 0 and "Permission denied" in before.stderr, (
        "the probe cannot fail: " + before.stderr
    )
    mounts = [{"host_path": str(shared), "path": "/mnt/dflash-shared", "ct_uid": 0}]
    cts = {"ct-a": {"pve_node": "pve1", "ct_vmid": 200}}
    run = play2(cts, ct_unprivileged=True, ct_features=[], ct_mount_points=mounts)
    assert run.rc == 0, run.error()
    assert (shared.stat().st_uid, shared.stat().st_gid) == (100000, 100000)
    after = as_ct_root(shared)
    assert after.returncode == 0, after.stderr
    again = play2(cts, ct_unprivileged=True, ct_features=[], ct_mount_points=mounts)
    assert again.rc == 0 and changed(again)["ct-a"] == 0, again.error()
