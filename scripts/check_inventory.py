"""Checks INVENTORY before a play reads it: it exists, every YAML file in it parses (an error names the file
and line), its vault files are encrypted, it has the groups the plays target, and each training CT's
configuration passes the trainer's own checks (trainer/src/dflash_trainer/config.py: its ConfigError names the
key) and its rank count agrees: [topology] of its train.toml, its ct_gpus and any trainer_service_nproc. Both
through the filter that renders the unit (roles/trainer_service/filter_plugins/dflash_train_config.py).

Several hosts (docs/multi-host.md): a CT's cluster is the `pve_cluster` of its Proxmox host (ct_proxmox_host;
hosts without one count as one cluster). VMIDs are unique across a cluster (pve-cluster src/PVE/Cluster.pm
check_vmid_unused, which the API's create runs: "CT 200 already exists on node 'pve1'"), so two CTs of one
cluster with one ct_vmid are refused here, before any API call. Where the inventory keeps its API token
secrets in `vault_pve_api_token_secrets` (one per cluster, as inventory/example does), each CT's cluster
needs its key. Values that are templates are left to roles/pve_container's preflight.

Vault rule: a file named vault.yml or vault.yaml under the inventory's group_vars/ or host_vars/ holds secrets
and must be ansible-vault encrypted (its first line starts with `$ANSIBLE_VAULT;`); a plain one is refused
before anything reads it. inventory/lab has none (its secrets are random files under lab_dir that `make lab`
writes); inventory/example's holds placeholders and is refused until a copy of it is filled in and encrypted.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import yaml

GROUPS = ("proxmox_hosts", "training_cts")
REPO = Path(__file__).resolve().parents[1]


def rank_problems(data: dict) -> list[str]:
    path = REPO / "roles/trainer_service/filter_plugins/dflash_train_config.py"
    spec = importlib.util.spec_from_file_location("dflash_train_config", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    reference = (REPO / "trainer/configs/reference.toml").read_text()
    hostvars = data.get("_meta", {}).get("hostvars", {})
    hosts = data.get("training_cts", {}).get("hosts", [])
    job = data.get("training_job", {}).get("hosts", [])  # one multi-node job: each CT holds its share
    return [
        p
        for h in hosts
        for p in module.host_problems(h, hostvars.get(h, {}), reference, len(job) if h in job else 1)
    ]


DEFAULT_VMID = 200  # roles/pve_container/defaults/main.yml ct_vmid
SECRETS_KEY = "vault_pve_api_token_secrets"


def cluster_of(ct: str, hostvars: dict) -> str:
    """The pve_cluster of the CT's Proxmox host; '' (one cluster for all such hosts) when unset."""
    host = hostvars.get(ct, {}).get("ct_proxmox_host", ct)
    return str(hostvars.get(host, {}).get("pve_cluster", ""))


def _cluster_name(cluster: str) -> str:
    return f"Proxmox cluster {cluster!r}" if cluster else "one Proxmox cluster (no pve_cluster set)"


def literal_vmid(value: object) -> int | None:
    """ct_vmid as an int, or None for a template (its value is known only in a play)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    text = str(value).strip()
    return int(text) if text.isdigit() else None


def vmid_problems(data: dict) -> list[str]:
    """One line per VMID that two or more CTs of one cluster share."""
    hostvars = data.get("_meta", {}).get("hostvars", {})
    by_id: dict[tuple[str, int], list[str]] = {}
    for ct in data.get("training_cts", {}).get("hosts", []):
        vmid = literal_vmid(hostvars.get(ct, {}).get("ct_vmid", DEFAULT_VMID))
        if vmid is not None:
            by_id.setdefault((cluster_of(ct, hostvars), vmid), []).append(ct)
    problems = []
    for (cluster, vmid), cts in sorted(by_id.items()):
        if len(cts) < 2:
            continue
        nodes = [str(hostvars.get(ct, {}).get("ct_proxmox_host", ct)) for ct in cts]
        where = f"{_cluster_name(cluster)} (on {', '.join(nodes)})"
        refusal = f"CT {vmid} already exists on node '{nodes[0]}'"
        problems.append(
            f"{' and '.join(cts)} share ct_vmid {vmid} in {where}: VMIDs are unique across a cluster, so "
            f'its API refuses the second ("{refusal}"); give each CT its own ct_vmid in its host vars, '
            "or set the hosts' pve_cluster if they are separate clusters"
        )
    return problems


def token_secret_problems(data: dict) -> list[str]:
    """One line per CT whose cluster has no key in vault_pve_api_token_secrets (when the inventory has it)."""
    hostvars = data.get("_meta", {}).get("hostvars", {})
    problems = []
    for ct in data.get("training_cts", {}).get("hosts", []):
        secrets = hostvars.get(ct, {}).get(SECRETS_KEY)
        if not isinstance(secrets, dict):
            continue
        cluster = cluster_of(ct, hostvars)
        if cluster not in secrets:
            host = hostvars.get(ct, {}).get("ct_proxmox_host", ct)
            have = sorted(secrets) or "none"
            problems.append(
                f"{ct} (on {host}, pve_cluster {cluster!r}) has no API token secret: {SECRETS_KEY} has no "
                f"key {cluster!r} (it has {have}); add the secret of that cluster's token to the vault"
            )
    return problems


VAULT_NAMES = ("vault.yml", "vault.yaml")
VAULT_HEADER = "$ANSIBLE_VAULT;"
YAML_SUFFIXES = (".yml", ".yaml")


class _AnsibleYaml(yaml.SafeLoader):
    """Safe YAML that accepts Ansible's tags (!vault, !unsafe) without building anything from them."""


_AnsibleYaml.add_multi_constructor("!", lambda loader, suffix, node: None)


def encrypted(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(len(VAULT_HEADER)) == VAULT_HEADER.encode()


def yaml_files(inventory: Path) -> list[Path]:
    if inventory.is_file():
        return [inventory]
    return sorted(p for p in inventory.rglob("*") if p.is_file() and p.suffix in YAML_SUFFIXES)


def syntax_error(path: Path) -> str | None:
    """'FILE line L, column C: PROBLEM' for a file that is not YAML; None when it parses (or is a vault)."""
    if encrypted(path):
        return None
    try:
        yaml.load(path.read_text(), Loader=_AnsibleYaml)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        context = (
            f" ({err.context} at line {err.context_mark.line + 1})"
            if err.context and err.context_mark
            else ""
        )
        return f"{path}{where}: YAML syntax error: {err.problem}{context}"
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        return f"{path}: not YAML: {err}"
    return None


def plain_vaults(inventory: Path) -> list[Path]:
    if not inventory.is_dir():
        return []
    found = []
    for tree in ("group_vars", "host_vars"):
        found += [p for p in (inventory / tree).rglob("*") if p.name in VAULT_NAMES and p.is_file()]
    return sorted(p for p in found if not encrypted(p))


def check(inventory: Path) -> list[str]:
    if not inventory.exists():
        return [f"INVENTORY={inventory}: no such file or directory (try inventory/lab or inventory/example)"]
    problems = [f"INVENTORY={inventory}: {e}" for p in yaml_files(inventory) if (e := syntax_error(p))]
    problems += [
        f"INVENTORY={inventory}: {vault} is not encrypted; a vault file holds secrets and is never read "
        f"in plain text: fill it in, then `ansible-vault encrypt {vault}` (inventory/example's holds "
        "placeholders: copy the directory first) and give the password through ANSIBLE_VAULT_PASSWORD_FILE"
        for vault in plain_vaults(inventory)
    ]
    if problems:
        return problems
    tool = str(Path(sys.executable).parent / "ansible-inventory")
    proc = subprocess.run([tool, "-i", str(inventory), "--list"], capture_output=True, text=True, check=False)
    if "no vault secrets" in proc.stderr:
        return [
            f"INVENTORY={inventory}: its vault files are encrypted and no vault password was given: "
            "set ANSIBLE_VAULT_PASSWORD_FILE to a file holding it"
        ]
    noise = [line for line in proc.stderr.splitlines() if "Unable to parse" in line or "ERROR" in line]
    if proc.returncode != 0 or noise:
        detail = (noise or proc.stderr.strip().splitlines() or ["no output"])[-1]
        return [f"INVENTORY={inventory}: cannot be parsed: {detail.strip()}"]
    data = json.loads(proc.stdout)
    problems = [f"group {g} has no hosts" for g in GROUPS if not data.get(g, {}).get("hosts")]
    problems += rank_problems(data) + vmid_problems(data) + token_secret_problems(data)
    return [f"INVENTORY={inventory}: {p}" for p in problems]


if __name__ == "__main__":
    problems = check(Path(sys.argv[1]))
    for line in problems:
        print(line, file=sys.stderr)
    sys.exit(1 if problems else 0)
