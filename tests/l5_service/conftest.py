"""The service scenarios run against the lab's CT 200 and its real systemd (tests/l5_service/lab.py)."""

from __future__ import annotations

import shutil

import pytest

from tests.l5_service import lab


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
