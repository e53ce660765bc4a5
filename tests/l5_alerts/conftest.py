"""The alert scenarios run against the lab CT's real systemd and the lab's webhook receiver on loopback.

The trainer environment, data and L5 unit are the service tests' (tests/l5_service/lab.py);
roles/trainer_alerts is converged on top with the tests' python, so the hooks run the notifier of this
checkout."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.request

import pytest

from lab import webhook_receiver
from tests.l5_service import lab
from tests.l5_service.conftest import firewall_play  # noqa: F401 (the firewall tests' runner, shared with L5's)

RECEIVED = f"http://{webhook_receiver.HOST}:{webhook_receiver.PORT}/received"
PYTHON = "/opt/dflash-svc-test/venv/bin/python"


def converge_alerts(*extra: str) -> None:
    env = os.environ | {
        "PATH": f"{lab.OPS}:{os.environ['PATH']}",
        "ANSIBLE_CONFIG": str(lab.REPO / "ansible/ansible.cfg"),
    }
    proc = subprocess.run(
        [str(lab.OPS / "ansible-playbook"), "-i", str(lab.REPO / "inventory/lab"),
         str(lab.REPO / "ansible/l5_alerts.yml"), "-l", lab.CT,
         "-e", f"trainer_alerts_python={PYTHON}", *extra],
        capture_output=True, text=True, env=env, timeout=600, check=False,
    )  # fmt: skip
    if proc.returncode != 0:
        raise AssertionError(
            f"converge of trainer_alerts failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-2000:]}"
        )


def received(since: float) -> list[dict]:
    """The messages the lab's receiver got after `since` (epoch seconds), with their arrival time."""
    with urllib.request.urlopen(RECEIVED, timeout=5) as reply:
        rows = [json.loads(line) for line in reply.read().decode().splitlines() if line.strip()]
    return [json.loads(r["body"]) | {"_at": r["time"]} for r in rows if r["time"] >= since]


def wait_message(since: float, event: str, timeout: float) -> dict:
    return lab.wait_for(
        lambda: next((m for m in received(since) if m["event"] == event), None),
        timeout,
        f"a {event!r} message",
    )


@pytest.fixture(scope="session")
def ct():
    if shutil.which("lxc-attach") is None or lab.sh("true", check=False).returncode != 0:
        pytest.skip(f"the lab container {lab.CT} is not running (make lab)")
    try:
        urllib.request.urlopen(RECEIVED, timeout=3)
    except OSError:
        pytest.skip(f"the lab's webhook receiver is not answering on {RECEIVED} (make lab)")
    lab.prepare()
    converge_alerts()
    yield lab
    lab.sh("systemctl stop dflash-train; systemctl reset-failed dflash-train", check=False)


@pytest.fixture
def fresh(ct):
    ct.sh(
        "systemctl stop dflash-train; systemctl reset-failed dflash-train; "
        "rm -rf /var/lib/dflash-svc-test/train/checkpoints /var/lib/dflash-svc-test/train/tensorboard "
        "/run/systemd/system/dflash-train.service.d/fault.conf; systemctl daemon-reload",
        check=False,
    )
    time.sleep(1)  # the stop's own message reaches the receiver before the test's clock starts
    return ct
