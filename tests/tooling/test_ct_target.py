"""scripts/ct_target.py: how make status, make logs and make tensorboard reach an inventory's training CT
(lxc-attach, ssh to the CT, ssh to its Proxmox host and `pct exec`), and the one line naming the inventory and
host when it cannot say. Temporary inventories through the real ansible-inventory; no lab."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lab.settings import REPO

SCRIPT = REPO / "scripts" / "ct_target.py"
BIN = Path(sys.executable).parent  # the tools venv: ansible-inventory beside its python

LXC = """
all:
  children:
    training_cts:
      hosts:
        lab-ct200:
          ansible_connection: community.general.lxc
          ansible_host: lab-ct200
"""
SSH = """
all:
  children:
    training_cts:
      hosts:
        ct200:
          ansible_host: 10.0.0.5
          ansible_user: trainer
          ct_venv_dir: /srv/venv
"""
PCT = """
all:
  children:
    proxmox_hosts:
      hosts:
        pve-01:
          ansible_host: 10.20.0.11
    training_cts:
      vars:
        ansible_connection: community.proxmox.proxmox_pct_remote
        ansible_user: root
      hosts:
        ct200-gpu-01:
          ansible_host: 10.99.0.1
          ct_proxmox_host: pve-01
          ct_vmid: 200
"""
PCT_NO_VMID = """
all:
  children:
    training_cts:
      hosts:
        ct200-gpu-01:
          ansible_connection: community.proxmox.proxmox_pct_remote
          ansible_host: 10.20.0.11
"""
PCT_NO_HOST = """
all:
  children:
    training_cts:
      hosts:
        ct200-gpu-01:
          ansible_connection: community.proxmox.proxmox_pct_remote
          ct_vmid: 200
"""
NO_CT = """
all:
  children:
    proxmox_hosts:
      hosts:
        pve-01:
          ansible_host: 10.20.0.11
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "hosts.yml"
    path.write_text(text)
    return path


def run(*args: str | Path) -> subprocess.CompletedProcess:
    env = os.environ | {"PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, env=env, timeout=120
    )


def fields(inventory: Path, *flags: str) -> dict[str, str]:
    """What the scripts see after `eval`: every ct_* variable, ct_exec's words joined by '|'."""
    shell = f'eval "$({sys.executable} {SCRIPT} {" ".join(flags)} {inventory})"; set | grep "^ct_[a-z]*="; '
    shell += 'printf "ct_exec=%s\\n" "$(IFS="|"; echo "${ct_exec[*]}")"'
    env = os.environ | {"PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    out = subprocess.run(["bash", "-c", shell], capture_output=True, text=True, env=env, check=True).stdout
    found = dict(line.split("=", 1) for line in out.splitlines())
    return {k: v.strip("'") for k, v in found.items()}


def test_the_lab_is_reached_with_lxc_attach(tmp_path: Path) -> None:
    got = fields(write(tmp_path, LXC))
    assert got["ct_kind"] == "lxc" and got["ct_address"] == "lab-ct200" and got["ct_host"] == "lab-ct200"
    assert got["ct_venv"] == "/opt/dflash/venv"  # ct_venv_dir's default
    assert got["ct_exec"] == "lxc-attach|-n|lab-ct200|--"


def test_a_ct_with_sshd_is_reached_over_ssh(tmp_path: Path) -> None:
    inventory = write(tmp_path, SSH)
    got = fields(inventory)
    assert (got["ct_kind"], got["ct_address"], got["ct_user"], got["ct_venv"]) == (
        "ssh", "10.0.0.5", "trainer", "/srv/venv"
    )  # fmt: skip
    assert got["ct_exec"] == "ssh|-o|BatchMode=yes|trainer@10.0.0.5"
    assert fields(inventory, "--tty")["ct_exec"] == "ssh|-o|BatchMode=yes|-t|trainer@10.0.0.5"


def test_a_proxmox_ct_is_reached_through_its_hosts_ssh_and_pct_exec(tmp_path: Path) -> None:
    got = fields(write(tmp_path, PCT), "--tty")
    # The Proxmox host's address from its own entry in the inventory, not the CT's ansible_host.
    assert (got["ct_kind"], got["ct_address"], got["ct_vmid"], got["ct_user"]) == (
        "pct", "10.20.0.11", "200", "root"
    )  # fmt: skip
    assert got["ct_exec"] == "ssh|-o|BatchMode=yes|-t|root@10.20.0.11|pct|exec|200|--"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (PCT_NO_VMID, "hosts.yml: host ct200-gpu-01 (ansible_connection "
                      "community.proxmox.proxmox_pct_remote) has no ct_vmid"),
        (PCT_NO_HOST, "hosts.yml: host ct200-gpu-01 (ansible_connection "
                      "community.proxmox.proxmox_pct_remote) names no Proxmox host"),
        (NO_CT, "hosts.yml: no host in group training_cts"),
        ("all: [not, a, mapping\n", "hosts.yml: ansible-inventory failed"),
    ],
)  # fmt: skip
def test_a_bad_inventory_is_named_with_the_host_at_fault(tmp_path: Path, text: str, message: str) -> None:
    proc = run(write(tmp_path, text))
    assert proc.returncode == 1 and proc.stdout == ""
    assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_a_missing_inventory_is_named(tmp_path: Path) -> None:
    proc = run(tmp_path / "nowhere")
    assert proc.returncode == 1
    assert proc.stderr.strip() == f"INVENTORY={tmp_path / 'nowhere'}: no such file or directory"


def test_the_operator_scripts_use_it() -> None:
    """make status, make logs and make tensorboard find the CT through this module only."""
    for name in ("status.sh", "logs.sh", "tensorboard.sh"):
        text = (REPO / "scripts" / name).read_text()
        assert "scripts/ct_target.py" in text and "ansible-inventory" not in text, name


def fake_tools(tmp_path: Path) -> Path:
    """ssh and lxc-attach that print their argument vector (one word a line) instead of connecting."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("ssh", "lxc-attach"):
        tool = bin_dir / name
        tool.write_text('#!/bin/sh\nprintf "%s\\n" "$(basename "$0")" "$@"\n')
        tool.chmod(0o755)
    return bin_dir


@pytest.mark.parametrize(
    ("text", "script", "words"),
    [
        (LXC, "status.sh", ["lxc-attach", "-n", "lab-ct200", "--", "/opt/dflash/venv/bin/python", "-m",
                            "dflash_trainer.alerts", "status"]),
        (PCT, "status.sh", ["ssh", "-o", "BatchMode=yes", "root@10.20.0.11", "pct", "exec", "200", "--",
                            "/opt/dflash/venv/bin/python", "-m", "dflash_trainer.alerts", "status"]),
        (SSH, "logs.sh", ["ssh", "-o", "BatchMode=yes", "-t", "trainer@10.0.0.5", "journalctl", "-f", "-n",
                          "100", "-u", "dflash-train", "--no-hostname", "-o", "short-iso"]),
        (SSH, "tensorboard.sh", ["tensorboard: http://127.0.0.1:6006/ (Ctrl-C stops it)", "ssh", "-o",
                                 "BatchMode=yes", "-o", "ExitOnForwardFailure=yes", "-L",
                                 "6006:127.0.0.1:6006", "trainer@10.0.0.5"]),
    ],
)  # fmt: skip
def test_the_scripts_run_their_command_over_the_connection(
    tmp_path: Path, text: str, script: str, words: list[str]
) -> None:
    env = os.environ | {
        "INVENTORY": str(write(tmp_path, text)),
        "VENV": str(BIN.parent),
        "PATH": f"{fake_tools(tmp_path)}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    proc = subprocess.run([REPO / "scripts" / script], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[: len(words)] == words


def test_tensorboard_names_the_one_command_for_a_pct_ct(tmp_path: Path) -> None:
    env = os.environ | {"INVENTORY": str(write(tmp_path, PCT)), "VENV": str(BIN.parent)}
    proc = subprocess.run(
        [REPO / "scripts" / "tensorboard.sh"], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 2
    assert "CT 200 is reached through pct exec on 10.20.0.11" in proc.stderr
    hint = "ssh root@10.20.0.11 pct exec 200 -- /opt/dflash/venv/bin/python -m tensorboard.main"
    assert hint in proc.stderr
