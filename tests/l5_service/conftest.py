"""The service scenarios run against the lab's CT 200 and its real systemd (tests/l5_service/lab.py); the
firewall tests (here and in tests/l5_alerts) play a role's rules against a private fakepve (firewall_play)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.l5_service import lab

BIN = Path(sys.executable).parent
# One role's tasks/firewall.yml on every host of a group, run on this machine against the fakepve's API.
FIREWALL_PLAY = """
- name: the firewall rules of {role} on each CT of {group}
  hosts: {group}
  connection: local
  gather_facts: false
  vars:
    ansible_python_interpreter: "{{{{ ansible_playbook_python }}}}"
  tasks:
    - name: firewall
      ansible.builtin.include_role:
        name: {role}
        tasks_from: firewall.yml
"""


@pytest.fixture(scope="session")
def ct():
    if shutil.which("lxc-attach") is None or lab.sh("true", check=False).returncode != 0:
        pytest.skip(f"the lab container {lab.CT} is not running (make lab)")
    lab.prepare()
    yield lab
    lab.sh("systemctl stop dflash-train; systemctl reset-failed dflash-train", check=False)


@pytest.fixture
def fresh(ct):
    """dflash-train stopped, no checkpoints, intact data, the role's own configuration."""
    ct.sh(
        "systemctl stop dflash-train; systemctl reset-failed dflash-train; "
        "rm -rf /var/lib/dflash-svc-test/train/checkpoints /var/lib/dflash-svc-test/train/tensorboard",
        check=False,
    )
    ct.stage_data()
    return ct


@dataclass(frozen=True)
class PlayRun:
    returncode: int
    stdout: str
    stderr: str

    @property
    def changed(self) -> int:
        """The tasks that changed something, summed over the hosts of the recap."""
        return sum(int(n) for n in re.findall(r"changed=(\d+)", self.stdout.split("PLAY RECAP")[-1]))


@dataclass(frozen=True)
class FirewallPlay:
    """A role's tasks/firewall.yml against a private fakepve (the fakepve package's pytest fixture, not the
    lab's daemon), through an API token that holds only what grant() gives it."""

    pve: Any
    tmp: Path
    token_id: str = "l2"
    secret: str = "token-secret"

    @property
    def token(self) -> str:
        return f"dflash@pve!{self.token_id}"

    def grant(self, *vmids: int) -> None:
        """VM.Audit and VM.Config.Network on each CT alone, as a least-privilege token holds them
        (pve-firewall's guest rules need VM.Config.Network on /vms/VMID)."""
        for vmid in vmids:
            self.pve.grant(self.token, f"/vms/{vmid}", "VM.Audit", "VM.Config.Network")

    def __call__(self, role: str, group: str, inventory: dict[str, Any]) -> PlayRun:
        """ROLE's firewall tasks on the hosts of GROUP of INVENTORY (a dict, as an inventory file holds); the
        API's variables go into GROUP's vars."""
        api = {
            "pve_api_host": self.pve.host,
            "pve_api_port": self.pve.port,
            "pve_api_user": "dflash@pve",
            "pve_api_token_id": self.token_id,
            "pve_api_token_secret": self.secret,
            "pve_api_validate_certs": False,
        }
        inventory[group]["vars"] = api | inventory[group].get("vars", {})
        (self.tmp / "inv.json").write_text(json.dumps(inventory))
        (self.tmp / "play.yml").write_text(FIREWALL_PLAY.format(role=role, group=group))
        env = os.environ | {
            "ANSIBLE_CONFIG": str(lab.REPO / "ansible/ansible.cfg"),
            "PATH": f"{BIN}:{os.environ['PATH']}",
            "ANSIBLE_NOCOLOR": "1",
        }
        cmd = [str(BIN / "ansible-playbook"), "-i", str(self.tmp / "inv.json"), str(self.tmp / "play.yml")]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False, timeout=300)
        return PlayRun(proc.returncode, proc.stdout, proc.stderr)


@pytest.fixture
def firewall_play(tmp_path: Path, fakepve) -> FirewallPlay:
    """The firewall tests' runner (tests/l5_service, tests/l5_alerts): the fakepve with its API token."""
    play = FirewallPlay(fakepve, tmp_path)
    fakepve.apitokens[play.token] = play.secret
    return play
