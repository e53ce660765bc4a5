"""The unit and train.toml that roles/trainer_service renders for the CTs of a multi-node job (the inventory
group training_job), and for a CT outside one (unchanged: the one-host launch). Rendered by ansible-playbook
on this machine through the role's own tasks, templates, vars and filters; no lab needed."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent

PLAY = """
- name: render the unit and train.toml of each CT
  hosts: training_cts
  connection: local
  gather_facts: false
  vars:
    ansible_python_interpreter: "{{ ansible_playbook_python }}"
    image_unit_dir: "{{ out }}/{{ inventory_hostname }}"
  tasks:
    - name: the unit, through the role
      ansible.builtin.include_role:
        name: trainer_service
        tasks_from: image_unit.yml
        public: true
    - name: train.toml, from the role's template
      ansible.builtin.template:
        src: "{{ repo }}/roles/trainer_service/templates/train.toml.j2"
        dest: "{{ image_unit_dir }}/train.toml"
        mode: "0644"
"""


def render(tmp: Path, inventory: dict) -> dict[str, tuple[str, dict]]:
    (tmp / "inv.yml").write_text(yaml.safe_dump(inventory))
    (tmp / "play.yml").write_text(PLAY)
    hosts = inventory["all"]["children"]["training_cts"]["hosts"]
    for h in hosts:
        (tmp / "out" / h / "systemd").mkdir(parents=True)
    path = f"{BIN}:{os.environ['PATH']}"
    env = os.environ | {"ANSIBLE_CONFIG": str(REPO / "ansible/ansible.cfg"), "PATH": path}
    cmd = [str(BIN / "ansible-playbook"), "-i", str(tmp / "inv.yml"), str(tmp / "play.yml")]
    cmd += ["-e", f"out={tmp / 'out'}", "-e", f"repo={REPO}"]
    # Outside the role (the train.toml task) role_path is not defined: name the reference by its path.
    cmd += ["-e", f"trainer_service_reference_config={REPO / 'trainer/configs/reference.toml'}"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return {
        h: (
            (tmp / "out" / h / "systemd/dflash-train.service").read_text(),
            tomllib.loads((tmp / "out" / h / "train.toml").read_text()),
        )
        for h in hosts
    }


def line(unit: str, key: str) -> str:
    return next(x for x in unit.splitlines() if x.startswith(key + "="))


CT_VARS = {
    "ct_gpus": [],
    "trainer_service_requires_stage_model": False,
    "trainer_service_config": {"topology": {"targets": 1, "drafters": 1}, "train": {"device": "cpu"}},
}


def test_a_job_of_two_cts_and_a_ct_alone(tmp_path: Path) -> None:
    inventory = {
        "all": {
            "children": {
                "training_cts": {"vars": CT_VARS, "hosts": {"ct-a": {}, "ct-b": {}, "ct-alone": {}}},
                "training_job": {
                    "vars": {
                        "training_job_name": "job7",
                        "training_job_port": 29444,
                        "training_job_socket_ifname": "eth1",
                        "training_job_checkpoint_dir": "/mnt/shared/ckpt",
                    },
                    "hosts": {
                        "ct-a": {"training_job_address": "10.30.0.21"},
                        "ct-b": {"training_job_address": "10.30.0.22"},
                    },
                },
            }
        }
    }
    units = render(tmp_path, inventory)
    for host, me in (("ct-a", "10.30.0.21"), ("ct-b", "10.30.0.22")):
        unit, config = units[host]
        assert line(unit, "ExecStart").endswith(
            "launch --nproc-per-node 1 --nnodes 2 --rdzv-endpoint 10.30.0.21:29444 --rdzv-id job7 "
            f"--local-addr {me} -- serve /etc/dflash/train.toml"
        ), unit
        preflight = " preflight --defer-probes --nproc 1 /etc/dflash/train.toml"
        assert any(x.endswith(preflight) for x in unit.splitlines()), unit
        assert "Environment=DFLASH_NNODES=2 NCCL_SOCKET_IFNAME=eth1 GLOO_SOCKET_IFNAME=eth1" in unit
        assert "DFLASH_NPROC=1" in unit
        assert line(unit, "Description") == (
            "Description=DFlash drafter training (1 of the 2 ranks of job job7 on 2 CTs)"
        )
        assert config["train"]["checkpoint_dir"] == "/mnt/shared/ckpt"
        assert config["topology"] == {"targets": 1, "drafters": 1}

    # A CT outside the job: the one-host launch.
    unit, config = units["ct-alone"]
    assert line(unit, "ExecStart").endswith("launch --nproc-per-node 2 -- serve /etc/dflash/train.toml"), unit
    assert line(unit, "Description") == "Description=DFlash drafter training (2 rank(s))"
    assert "DFLASH_NNODES" not in unit and "NCCL_SOCKET_IFNAME" not in unit and "DFLASH_NPROC=2" in unit
    assert config["train"]["checkpoint_dir"] == "/var/lib/dflash/train/checkpoints"
