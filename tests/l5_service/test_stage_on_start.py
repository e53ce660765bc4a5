"""/dev/shm emptied without a reboot (docs/data-layer.md#how-the-pieces-behave). The staging unit stays active
(a oneshot that ran at boot), so only the trainer's own start can notice: its ExecStartPre runs
dflash-stage-model with the settings of L4 and restages the model before the trainer loads it. Once, with the
cause in the journal: not a restart loop in which the staging unit never runs again.

Runs against the lab as `make provision` leaves it (L4 and L5 converged here first, from this tree), moves
the trainer's checkpoints aside for the run and puts them back, and leaves dflash-train as it found it.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from tests.l5_service import lab

STAGED = "/dev/shm/dflash/model"
STATE = "/var/lib/dflash/train"


def provision_l4_l5() -> None:
    env = os.environ | {
        "PATH": f"{lab.OPS}:{os.environ['PATH']}",
        "ANSIBLE_CONFIG": str(lab.REPO / "ansible/ansible.cfg"),
        "ANSIBLE_NOCOLOR": "1",
    }
    proc = subprocess.run(
        [
            str(lab.OPS / "ansible-playbook"),
            "-i",
            str(lab.REPO / "inventory/lab"),
            str(lab.REPO / "ansible/site.yml"),
            "--tags",
            "l4,l5",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        check=False,
    )
    assert proc.returncode == 0, f"make provision TAGS=l4,l5 failed:\n{proc.stdout[-3000:]}"


@pytest.fixture(scope="module")
def provisioned():
    if shutil.which("lxc-attach") is None or lab.sh("true", check=False).returncode != 0:
        pytest.skip(f"the lab container {lab.CT} is not running (make lab)")
    provision_l4_l5()
    was_active = lab.show("ActiveState") == "active"
    lab.sh(
        f"systemctl stop dflash-train; systemctl reset-failed dflash-train; "
        f"rm -rf {STATE}/checkpoints.test-aside; "
        f"if [ -d {STATE}/checkpoints ]; then mv {STATE}/checkpoints {STATE}/checkpoints.test-aside; fi",
        check=False,
    )
    yield
    lab.sh(
        f"systemctl stop dflash-train; systemctl reset-failed dflash-train; rm -rf {STATE}/checkpoints; "
        f"if [ -d {STATE}/checkpoints.test-aside ]; then "
        f"mv {STATE}/checkpoints.test-aside {STATE}/checkpoints; fi",
        check=False,
    )
    if was_active:
        lab.sh("systemctl start dflash-train", check=False, timeout=300)


def test_emptied_dev_shm_is_restaged_by_the_trainers_start(provisioned) -> None:
    assert "dflash-stage-model" in lab.show("ExecStartPre"), "the unit has no staging ExecStartPre"
    lab.sh(f"rm -rf {STAGED}")
    assert lab.show("ActiveState", "dflash-stage-model") == "active"  # it ran at boot; it will not again
    mark = lab.cursor()
    lab.sh("systemctl start dflash-train", timeout=300)  # Type=notify: returns at READY or fails
    assert lab.show("ActiveState") == "active"
    assert lab.show("NRestarts") == "0"
    log = lab.journal(mark)
    assert f"{STAGED}: staging needed: {STAGED}: not staged" in log, log[-2000:]
    assert f"{STAGED}: staged " in log and "every file's sha256 checked" in log
    lab.sh("/usr/local/sbin/dflash-stage-model --config /etc/dflash/stage-model.json --check")
