"""The two-CT lab of inventory/lab-multinode, provisioned (`make test-multinode` builds and provisions it)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from tests.l5_service import lab

CTS = ("lab-ct201", "lab-ct202")
SHARED = "/mnt/dflash-shared"
CHECKPOINTS = f"{SHARED}/checkpoints"
# The trainer's user: the shared storage is an NFS export (the lab's stand-in, lab/nfs_standin.py), where the
# CT's root is a plain user who may neither read nor write the trainer's files.
TRAINER = yaml.safe_load((Path(lab.REPO) / "roles/trainer_service/defaults/main.yml").read_text())[
    "trainer_service_user"
]


def stop_both() -> None:
    for ct in CTS:
        lab.sh(
            "systemctl stop dflash-train; systemctl reset-failed dflash-train",
            ct=ct,
            check=False,
            timeout=180,
        )


@pytest.fixture(scope="session")
def cts():
    for ct in CTS:
        if shutil.which("lxc-attach") is None or lab.sh("true", ct=ct, check=False).returncode != 0:
            pytest.fail(
                f"the lab container {ct} is not running: make lab LAB_INVENTORY=inventory/lab-multinode"
            )
        if lab.sh("test -f /etc/systemd/system/dflash-train.service", ct=ct, check=False).returncode != 0:
            pytest.fail(f"{ct} has no dflash-train.service: make provision INVENTORY=inventory/lab-multinode")
    yield CTS
    stop_both()


@pytest.fixture
def job(cts):
    """Both units stopped, the job's shared checkpoint directory empty."""
    stop_both()
    lab.sh(f"rm -rf {CHECKPOINTS}/* {CHECKPOINTS}/.tmp-*", ct=cts[0], user=TRAINER)
    yield cts
    stop_both()
