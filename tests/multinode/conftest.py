"""The two-CT lab of inventory/lab-multinode, provisioned (`make test-multinode` builds and provisions it)."""

from __future__ import annotations

import shutil

import pytest

from tests.l5_service import lab

CTS = ("lab-ct201", "lab-ct202")
SHARED = "/mnt/dflash-shared"
CHECKPOINTS = f"{SHARED}/checkpoints"


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
    lab.sh(f"rm -rf {CHECKPOINTS}/* {CHECKPOINTS}/.tmp-*", ct=cts[0])
    yield cts
    stop_both()
