"""Fixtures for the L2 role's behaviour tests.

A private fakepve (the plugin's `fakepve` fixture) with an ACL, so devN entries and feature flags on a
privileged CT need root@pam with a password as on a real host, and a runner that plays the L2 playbook
against it from a throw-away inventory, the Proxmox host's side (/dev, /etc/pve/lxc) in a temporary directory.
"""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fakepve.pytest_plugin as fakepve_plugin
import pytest

from lab.fakepve_daemon import LAB_TIME_SCALE, LabFakePve

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
GPUS = [0, 1]
# The msg of the first failed task in the default callback's YAML output, with its wrapped lines.
FAILURE = re.compile(r"(?:fatal|failed): \[[^\]]+\][^\n]*\n(?:.*\n)*?\s*msg: (.*(?:\n {6,}\S.*)*)")


@dataclass
class Run:
    rc: int
    out: str

    @property
    def recap(self) -> dict[str, int]:
        m = re.search(r"ct200-test\s*:\s*(.*)", self.out.split("PLAY RECAP")[-1])
        return {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", m.group(1))} if m else {}

    @property
    def changed(self) -> int:
        return self.recap.get("changed", -1)

    def error(self) -> str:
        """The first failure message of the run, its wrapped lines joined."""
        found = FAILURE.search(self.out)
        if found:
            return " ".join(found.group(1).split()).strip("'\" ")
        # A no_log task's result is censored; Ansible's error line still carries the module's msg.
        module = re.search(r"\[ERROR\]: Task failed: Module failed: (.*)", self.out)
        return module.group(1).strip() if module else self.out[-2000:]


@pytest.fixture
def fakepve(request, _fakepve_pki, monkeypatch):
    """The plugin's fakepve fixture, served by the lab's LabFakePve (lab/fakepve_daemon.py): it answers a CT's
    description and a host shutdown as a real PVE host does, so the tests see what the lab's daemon shows.
    Its tasks take time as the lab daemon's do (LAB_TIME_SCALE), unless a `fakepve(time_scale=...)` marker
    says otherwise."""
    monkeypatch.setattr(fakepve_plugin, "FakePve", LabFakePve)
    marker = request.node.get_closest_marker("fakepve")
    options = fakepve_plugin._options(request)
    if marker is None or "time_scale" not in marker.kwargs:
        options["time_scale"] = LAB_TIME_SCALE
    serving = fakepve_plugin._serve(options, _fakepve_pki)
    try:
        yield serving.pve
    finally:
        serving.stop()


@pytest.fixture
def pve(fakepve):
    """fakepve with an ACL in place: root@pam (password) may do anything, a token only what it is granted."""
    fakepve.apitokens["root@pam!ci"] = "token-secret"
    fakepve.grant(
        "root@pam!ci",
        "/",
        "VM.Audit",
        "VM.Allocate",
        "VM.Config.CPU",
        "VM.Config.Memory",
        "VM.Config.Network",
        "VM.Config.Options",
        "VM.Config.Disk",
        "VM.PowerMgmt",
        "Sys.Modify",
        "Datastore.AllocateSpace",
        "Datastore.AllocateTemplate",
        "Datastore.Audit",
        "Sys.Audit",
        "SDN.Use",
    )
    return fakepve


@pytest.fixture
def lab(tmp_path: Path, pve) -> dict[str, Any]:
    """The host side in tmp_path: a /dev with GPU nodes (character devices), /etc/pve/lxc, a template."""
    dev = tmp_path / "dev"
    (dev / "nvidia-caps").mkdir(parents=True)
    for name, minor in [
        *((f"nvidia{g}", g) for g in GPUS),
        ("nvidiactl", 255),
        ("nvidia-uvm", 0),
        ("nvidia-uvm-tools", 1),
        ("nvidia-caps/nvidia-cap1", 1),
        ("nvidia-caps/nvidia-cap2", 2),
    ]:
        os.mknod(dev / name, stat.S_IFCHR | 0o666, os.makedev(195 if "uvm" not in name else 511, minor))
    template = tmp_path / "debian-12-test_amd64.tar.zst"
    template.write_bytes(b"(\xb5/\xfd\x00\x00\x01\x00\x00")  # fakepve never unpacks it
    return {
        "ct_gpus": GPUS,
        "ct_host_dev_dir": str(dev),
        "ct_pve_conf_dir": str(tmp_path / "pve" / "lxc"),
        "ct_pve_conf_create": True,
        "ct_template_src": str(template),
        "ct_wait_for_boot": False,
        "ct_memory_mb": 4096,
        "ct_shm_size_mb": 512,
        "ct_trainer_memory_mb": 1024,
        "ct_rootfs_size_gb": 8,
        "ct_features": ["nesting=1"],
        "ct_hwaddr": "BC:24:11:AA:BB:CC",
        "ct_memlock": "unlimited",
        "pve_api_host": pve.host,
        "pve_api_port": pve.port,
        "pve_api_user": "root@pam",
        "pve_api_password": "secret",
        "pve_api_validate_certs": False,
        "pve_api_timeout_s": 10,
        "pve_node": "pve1",
    }


@pytest.fixture
def play(tmp_path: Path, lab: dict[str, Any], pve):
    """play(*args, **overrides) runs ansible/l2_container.yml against the fake, args added to
    ansible-playbook's (e.g. --check); returns Run."""

    def run(*args: str, **overrides: Any) -> Run:
        inventory = tmp_path / "inventory.json"
        host_vars = {
            **lab,
            **overrides,
            "ansible_connection": "local",
            "ansible_python_interpreter": sys.executable,
            "ct_proxmox_host": "pve-test",
        }
        inventory.write_text(
            json.dumps(
                {
                    "proxmox_hosts": {
                        "hosts": {
                            "pve-test": {
                                "ansible_connection": "local",
                                "ansible_python_interpreter": sys.executable,
                            }
                        }
                    },
                    "training_cts": {"hosts": {"ct200-test": host_vars}},
                }
            )
        )
        # The host's `pct`: lab/pct_standin/pct, calling this fakepve as root@pam, as root on a host would.
        bindir = tmp_path / "hostbin"
        bindir.mkdir(exist_ok=True)
        if not (bindir / "pct").exists():
            (bindir / "pct").symlink_to(REPO / "lab" / "pct_standin" / "pct")
        pct_conf = tmp_path / "lab-pct.json"
        url = f"https://{host_vars['pve_api_host']}:{host_vars['pve_api_port']}"
        pct_conf.write_text(
            json.dumps({"url": url, "node": "pve1", "user": "root@pam", "password": "secret"})
        )
        env = {
            "PATH": f"{bindir}:{BIN}:{os.environ['PATH']}",
            "LAB_PCT_CONFIG": str(pct_conf),
            # The heartbeat callback's line while a task waits on a Proxmox task (a create, a restart).
            "DFLASH_HEARTBEAT_S": "2",
        }
        return ansible_playbook(
            *args, "-i", str(inventory), str(REPO / "ansible" / "l2_container.yml"), env=env
        )

    return run


def ansible_playbook(*args: str, env: dict[str, str] | None = None) -> Run:
    """ansible-playbook of the venv with the project's ansible.cfg, uncoloured, ENV over this process's."""
    full_env = {
        **os.environ,
        "PATH": f"{BIN}:{os.environ['PATH']}",
        "ANSIBLE_CONFIG": str(REPO / "ansible" / "ansible.cfg"),
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_FORCE_COLOR": "0",
        **(env or {}),
    }
    proc = subprocess.run(
        [str(BIN / "ansible-playbook"), *args],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=600,
        check=False,
    )
    return Run(proc.returncode, proc.stdout + proc.stderr)
