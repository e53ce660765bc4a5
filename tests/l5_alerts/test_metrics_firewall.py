"""roles/trainer_metrics' firewall rule (tasks/firewall.yml) against a private fakepve (the package's pytest
fixture, as tests/l5_service/test_training_job_firewall.py does for the job's rules): TCP in to
node_exporter's port from the monitoring addresses only, at the role's position; a second run changes
nothing."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent

PLAY = """
- name: the metrics rule of each CT
  hosts: training_cts
  connection: local
  gather_facts: false
  vars:
    ansible_python_interpreter: "{{ ansible_playbook_python }}"
  tasks:
    - name: firewall
      ansible.builtin.include_role:
        name: trainer_metrics
        tasks_from: firewall.yml
"""


def play(tmp: Path, pve) -> subprocess.CompletedProcess:
    common = {
        "pve_api_host": pve.host,
        "pve_api_port": pve.port,
        "pve_api_user": "dflash@pve",
        "pve_api_token_id": "l2",
        "pve_api_token_secret": "token-secret",
        "pve_api_validate_certs": False,
        "trainer_metrics_sources": ["10.20.0.5", "10.20.1.0/24"],
        "trainer_metrics_port": 9100,
        "trainer_metrics_firewall_pos": 0,
    }
    inventory = {"training_cts": {"vars": common, "hosts": {"ct-a": {"ct_vmid": 200}}}}
    (tmp / "inv.json").write_text(json.dumps(inventory))
    (tmp / "play.yml").write_text(PLAY)
    env = os.environ | {
        "ANSIBLE_CONFIG": str(REPO / "ansible/ansible.cfg"),
        "PATH": f"{BIN}:{os.environ['PATH']}",
        "ANSIBLE_NOCOLOR": "1",
    }
    cmd = [str(BIN / "ansible-playbook"), "-i", str(tmp / "inv.json"), str(tmp / "play.yml")]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, check=False, timeout=300)


def changed(out: str) -> int:
    return sum(int(n) for n in re.findall(r"changed=(\d+)", out.split("PLAY RECAP")[-1]))


def test_the_metrics_port_opens_to_the_monitoring_addresses_only(tmp_path: Path, fakepve) -> None:
    fakepve.add_ct(200, name="ct200-a")
    fakepve.apitokens["dflash@pve!l2"] = "token-secret"
    fakepve.grant("dflash@pve!l2", "/vms/200", "VM.Audit", "VM.Config.Network")

    first = play(tmp_path, fakepve)
    assert first.returncode == 0, first.stdout + first.stderr
    assert changed(first.stdout) == 1, first.stdout
    rules = fakepve.firewall_config("ct", "pve1", "200")["rules"]
    got = [(r["type"], r["action"], r["proto"], r["source"], r["dport"]) for r in rules]
    assert got == [("in", "ACCEPT", "tcp", "10.20.0.5,10.20.1.0/24", "9100")], rules
    assert "token-secret" not in first.stdout

    second = play(tmp_path, fakepve)
    assert second.returncode == 0, second.stdout + second.stderr
    assert changed(second.stdout) == 0, second.stdout
