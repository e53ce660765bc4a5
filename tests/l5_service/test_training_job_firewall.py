"""roles/training_job's firewall rules for CT 200 (tasks/firewall.yml) against a private fakepve
(conftest.py's firewall_play): TCP in to the rendezvous port and the ranks' range, from the job's other CTs
only, at the positions the role owns; a second run changes nothing. The token holds VM.Audit and
VM.Config.Network on its CT alone, as a least-privilege token would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def job_inventory() -> dict:
    return {
        "training_cts": {"hosts": {"ct-a": {}, "ct-b": {}}},
        "training_job": {
            "vars": {
                "training_job_name": "job7",
                "training_job_port": 29444,
                "training_job_port_range": "29500 29999",
            },
            "hosts": {
                "ct-a": {"ct_vmid": 200, "training_job_address": "10.30.0.21"},
                "ct-b": {"ct_vmid": 201, "training_job_address": "10.30.0.22"},
            },
        },
    }


def test_the_job_ports_open_from_the_other_ct_only(fakepve, firewall_play) -> None:
    fakepve.add_ct(200, name="ct200-a")
    fakepve.add_ct(201, name="ct200-b")
    firewall_play.grant(200, 201)

    first = firewall_play("training_job", "training_job", job_inventory())
    assert first.returncode == 0, first.stdout + first.stderr
    assert first.changed == 2, first.stdout
    for vmid, peer in ((200, "10.30.0.22"), (201, "10.30.0.21")):
        rules = fakepve.firewall_config("ct", "pve1", str(vmid))["rules"]  # in position order
        got = [(p, r["type"], r["action"], r["proto"], r["source"], r["dport"]) for p, r in enumerate(rules)]
        assert got == [
            (0, "in", "ACCEPT", "tcp", peer, "29444"),
            (1, "in", "ACCEPT", "tcp", peer, "29500:29999"),
        ], rules
        assert all(int(r.get("enable", 0)) == 1 and "dflash job job7" in r["comment"] for r in rules)

    second = firewall_play("training_job", "training_job", job_inventory())
    assert second.returncode == 0, second.stdout + second.stderr
    assert second.changed == 0, second.stdout


PREFLIGHT = """
- name: the job's preflight on each CT
  hosts: training_job
  connection: local
  gather_facts: false
  vars:
    ansible_python_interpreter: "{{ ansible_playbook_python }}"
  tasks:
    - name: preflight
      ansible.builtin.include_role:
        name: training_job
        tasks_from: preflight.yml
"""


def preflight(tmp: Path, job_vars: dict, hosts: dict) -> str:
    inventory = {
        "training_cts": {"hosts": {h: {} for h in hosts}},
        "training_job": {"vars": job_vars, "hosts": hosts},
    }
    (tmp / "inv.json").write_text(json.dumps(inventory))
    (tmp / "preflight.yml").write_text(PREFLIGHT)
    env = os.environ | {
        "ANSIBLE_CONFIG": str(REPO / "ansible/ansible.cfg"),
        "PATH": f"{BIN}:{os.environ['PATH']}",
    }
    cmd = [str(BIN / "ansible-playbook"), "-i", str(tmp / "inv.json"), str(tmp / "preflight.yml")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False, timeout=300)
    assert proc.returncode != 0, proc.stdout
    return " ".join(proc.stdout.split())


def test_the_preflight_names_what_is_wrong(tmp_path: Path) -> None:
    local = {"training_job_socket_ifname": "lo", "training_job_checkpoint_dir": str(tmp_path)}
    two = {"ct-a": {"training_job_address": "10.30.0.21"}, "ct-b": {"training_job_address": "10.30.0.21"}}
    out = preflight(tmp_path, local, two)
    assert "each with its own training_job_address (got ['10.30.0.21', '10.30.0.21'])" in out, out

    two["ct-b"]["training_job_address"] = "10.30.0.22"
    out = preflight(tmp_path, local | {"training_job_port_range": "29000 29999"}, two)
    assert 'got 29400 and "29000 29999"' in out, out  # the rendezvous port inside the ranks' range

    out = preflight(tmp_path, local | {"training_job_socket_ifname": "ib7"}, two)
    assert "training_job_socket_ifname ib7 is not an interface of the CT" in out, out

    out = preflight(tmp_path, local | {"training_job_rdma_devices": ["infiniband/uverbs9"]}, two)
    assert "/dev/infiniband/uverbs9 (training_job_rdma_devices) is not a character device in the CT" in out, (
        out
    )

    out = preflight(tmp_path, local, two)  # a local directory: not the shared storage every node needs
    assert f"training_job_checkpoint_dir {tmp_path} is on " in out and "not on shared storage" in out, out
