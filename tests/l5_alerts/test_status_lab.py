"""`make status` (scripts/status.sh over the lab inventory's connection, lxc-attach): one screen with the
unit's state, step, tokens/s, loss, the newest checkpoint, restarts since boot and the last failure with its
cause."""

from __future__ import annotations

import os
import re
import subprocess
import time

from tests.l5_alerts.conftest import PYTHON
from tests.l5_service import lab


def status() -> dict[str, str]:
    proc = subprocess.run(
        [str(lab.REPO / "scripts/status.sh")],
        env=os.environ | {"INVENTORY": "inventory/lab", "TRAINER_PYTHON": PYTHON},
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rows = {}
    for line in proc.stdout.splitlines():
        key, _, value = line.partition("  ")
        rows[key.strip()] = value.strip()
    return rows


def test_status_tells_the_run_and_its_last_failure_on_one_screen(fresh):
    ct = fresh
    ct.sh("systemctl start --no-block dflash-train")
    ct.wait_for(lambda: (ct.status_step() or 0) >= 25, 240, "STATUS at step 25")
    boot_restarts = int(re.match(r"\d+", status()["restarts"]).group())
    rows = status()
    assert rows["unit"] == "dflash-train.service: active (running)", rows
    step = int(rows["step"].split()[0].rstrip(","))
    assert step >= 20, rows
    assert re.match(r"\d+ \(run median \d+\)", rows["tokens/s"]), rows
    assert float(rows["loss"]) > 0
    assert re.match(
        r"step \d+, \d+ s ago \(/var/lib/dflash-svc-test/train/checkpoints/step-\d{8}\)", rows["checkpoint"]
    )
    assert len(rows) <= 14  # one screen

    rank = ct.sh(f"pgrep -P {ct.show('MainPID')}").stdout.split()[0]
    killed = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(int(time.time())))
    ct.sh(f"kill -9 {rank}")

    def told() -> dict[str, str] | None:  # the drain's record of this failure, and systemd's restart
        rows = status()
        restarts = int(re.match(r"\d+", rows["restarts"]).group())
        return rows if rows.get("last failure", "")[:19] >= killed and restarts > boot_restarts else None

    rows = ct.wait_for(told, 60, "the failure and the restart in the status")
    assert "rank 0 (target) killed by SIGKILL" in rows["last failure"], rows
    assert int(re.match(r"\d+", rows["restarts"]).group()) == boot_restarts + 1, rows
    ct.sh("systemctl stop dflash-train", check=False, timeout=130)
