"""Several Proxmox hosts in one inventory (docs/multi-host.md), as scripts/check_inventory.py sees them before
any play: one VMID per CT of a cluster (pve-cluster src/PVE/Cluster.pm check_vmid_unused: VMIDs are unique
across a cluster, the API's create refuses "CT 200 already exists on node 'pve1'"), and an API token secret
for the cluster of every CT. CPU-only: copies of inventory/example under tmp_path, its vault encrypted."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from lab.settings import REPO
from tests.inventory.test_check_inventory import encrypt_vault

CHECK = REPO / "scripts" / "check_inventory.py"
BIN = Path(sys.executable).parent


def example(tmp_path: Path, vault_extra: str = "") -> tuple[Path, dict[str, str]]:
    """A copy of inventory/example with its vault (plus vault_extra) encrypted, and the env to check it."""
    inv = Path(shutil.copytree(REPO / "inventory" / "example", tmp_path / "example"))
    vault = inv / "group_vars" / "all" / "vault.yml"
    if vault_extra:
        first = "  gpu-a: CHANGE-ME\n"
        vault.write_text(vault.read_text().replace(first, first + vault_extra))
    password = encrypt_vault(vault, tmp_path)
    env = {**os.environ, "ANSIBLE_VAULT_PASSWORD_FILE": str(password)}
    return inv, env


def check(inventory: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(CHECK), str(inventory)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )


def set_vmid(inv: Path, ct: str, vmid: int) -> None:
    hosts = inv / "hosts.yml"
    text = hosts.read_text()
    block = re.compile(rf"(\n        {ct}:\n(?:          .*\n)*?          ct_vmid: )\d+")
    assert block.search(text), f"{ct} has no ct_vmid line in {hosts}"
    hosts.write_text(block.sub(rf"\g<1>{vmid}", text, count=1))


def second_cluster(inv: Path, host: str, name: str) -> None:
    (inv / "host_vars").mkdir(exist_ok=True)
    (inv / "host_vars" / f"{host}.yml").write_text(f"---\npve_cluster: {name}\n")


def test_the_examples_cts_of_one_cluster_have_their_own_ids(tmp_path: Path) -> None:
    inv, env = example(tmp_path)
    hosts = yaml.safe_load((inv / "hosts.yml").read_text())["all"]["children"]
    cts = hosts["training_cts"]["hosts"]
    ids = {name: ct["ct_vmid"] for name, ct in cts.items()}
    assert len(set(ids.values())) == len(ids), f"the example's CTs share an id: {ids}"
    proc = check(inv, env)
    assert proc.returncode == 0, proc.stderr


def test_one_vmid_twice_in_one_cluster_is_one_line_naming_both_cts(tmp_path: Path) -> None:
    inv, env = example(tmp_path)
    set_vmid(inv, "ct201-gpu-02", 200)
    proc = check(inv, env)
    assert proc.returncode == 1
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert "ct200-gpu-01 and ct201-gpu-02 share ct_vmid 200 in Proxmox cluster 'gpu-a'" in lines[0], lines[0]
    assert "CT 200 already exists on node 'pve-gpu-01'" in lines[0]


def test_hosts_of_two_clusters_may_reuse_an_id_with_their_own_token(tmp_path: Path) -> None:
    inv, env = example(tmp_path, vault_extra="  gpu-b: CHANGE-ME-TOO\n")
    set_vmid(inv, "ct201-gpu-02", 200)
    second_cluster(inv, "pve-gpu-02", "gpu-b")
    proc = check(inv, env)
    assert proc.returncode == 0, proc.stderr


def test_a_ct_whose_cluster_has_no_token_secret_is_named_with_the_key(tmp_path: Path) -> None:
    inv, env = example(tmp_path)
    second_cluster(inv, "pve-gpu-02", "gpu-b")
    proc = check(inv, env)
    assert proc.returncode == 1
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert "ct201-gpu-02 (on pve-gpu-02, pve_cluster 'gpu-b') has no API token secret" in lines[0], lines[0]
    assert "vault_pve_api_token_secrets has no key 'gpu-b'" in lines[0]
    assert "CHANGE-ME" not in proc.stderr  # the secrets themselves are never printed


def test_hosts_without_pve_cluster_count_as_one_cluster(tmp_path: Path) -> None:
    inv = Path(shutil.copytree(REPO / "inventory" / "lab", tmp_path / "lab"))
    hosts = inv / "hosts.yml"
    text = hosts.read_text()
    twin = (
        "        lab-ct201:\n          ansible_connection: community.general.lxc\n"
        "          ct_proxmox_host: lab-host2\n"
    )
    text = text.replace("    training_cts:\n      hosts:\n", f"    training_cts:\n      hosts:\n{twin}")
    text = text.replace(
        "    proxmox_hosts:\n      hosts:\n",
        "    proxmox_hosts:\n      hosts:\n        lab-host2:\n          ansible_connection: local\n",
    )
    hosts.write_text(text)
    proc = check(inv, {k: v for k, v in os.environ.items() if k != "ANSIBLE_VAULT_PASSWORD_FILE"})
    assert proc.returncode == 1
    pair = r"lab-ct20[01] and lab-ct20[01] share ct_vmid 200 in one Proxmox cluster \(no pve_cluster set\)"
    assert re.search(pair, proc.stderr), proc.stderr
