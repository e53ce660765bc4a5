"""A reboot of CT 200 with the two-rank job running: systemd stops the unit (SIGTERM: each rank finishes its
step, the drafter saves), the container boots, the enabled unit starts again and resumes at the saved step."""

from __future__ import annotations

import os
import time

import pytest

from tests.l5_service.test_service import START_S, start_and_wait_step


def test_a_reboot_saves_and_the_job_resumes_at_that_step(fresh):
    ct = fresh
    assert ct.show("UnitFileState") == "enabled", "the unit must start at boot"
    start_and_wait_step(ct, 12)
    before = ct.wait_for(ct.checkpoints, 120, "a periodic checkpoint")[-1]
    ct.sh("systemctl reboot", check=False)  # the attach may end with the container's shutdown
    time.sleep(3)

    def booted() -> bool:
        state = ct.sh("systemctl is-system-running", check=False).stdout.strip()
        return state in ("running", "degraded")

    ct.wait_for(booted, 300, "the container to boot again", interval=2)

    def resumed_line() -> str | None:
        lines = [line for line in ct.journal().splitlines() if "resumed from" in line]
        return lines[-1] if lines else None

    resumed = ct.wait_for(resumed_line, START_S, "the enabled unit to resume after the boot")
    step = int(resumed.rsplit("step ", 1)[1].rstrip(")"))
    # The shutdown saved where the job was (at least the periodic checkpoint); this boot went on from there.
    log = ct.journal().splitlines()
    before_boot = log[: max(i for i, line in enumerate(log) if "resumed from" in line)]
    stopped = [line for line in before_boot if "stopped at step" in line]
    assert stopped and f"stopped at step {step};" in stopped[-1], (step, stopped[-1:])
    assert step >= before > 0, (before, resumed)
    assert ct.show("NRestarts") == "0"  # a clean start of this boot, not a restart after a crash
    print(f"\nperiodic checkpoint at {before} before the reboot; after it: {resumed}")


# What a real host's boot of CT 200 holds that the lab's does not: staging tens of GB into /dev/shm and
# the trainer's start to READY (preflight, imports, the target's load) take minutes, and multi-user.target
# waits for them (systemd.target(5): a target is ordered after the units it wants). A sleep before the unit's
# start stands in for them; a unit of another name that sleeps at boot stands in for a boot that hangs.
SLOW_TRAINER = "/etc/systemd/system/dflash-train.service.d/zz-test-slow-start.conf"
SLOW_OTHER = "/etc/systemd/system/zz-test-slow-boot.service"
SLOW = {
    SLOW_TRAINER: "[Service]\\nExecStartPre=/bin/sleep 150\\n",  # printf's escapes
    SLOW_OTHER: "[Service]\\nType=oneshot\\nExecStart=/bin/sleep 60\\n"
    "[Install]\\nWantedBy=multi-user.target\\n",
}


def reboot_with_a_slow_start(ct, path: str) -> None:
    """CT 200 rebooted with `path` in place, and back once its boot queued that unit's start."""
    unit = "dflash-train.service" if path == SLOW_TRAINER else os.path.basename(path)
    ct.sh(f"mkdir -p {os.path.dirname(path)} && printf '{SLOW[path]}' > {path} && systemctl daemon-reload")
    if path == SLOW_OTHER:
        ct.sh(f"systemctl enable {unit}")
    ct.sh("systemctl reboot", check=False)
    time.sleep(3)

    def queued() -> bool:
        jobs = ct.sh("systemctl list-jobs --no-legend --plain", check=False)
        return jobs.returncode == 0 and unit in jobs.stdout

    ct.wait_for(queued, 120, f"the boot to queue {unit}", interval=1)


@pytest.mark.parametrize("slow", [SLOW_TRAINER, SLOW_OTHER], ids=["trainer", "another-unit"])
def test_l2_after_a_boot_waits_for_the_boot_not_for_the_training_to_load(fresh, slow):
    """`make provision` just after CT 200 (re)booted, or L2's own restart after a config change: L2 waits for
    the CT's boot, not for the training's units that start at every boot, says they are still starting, and
    changes nothing. A boot that another unit holds up past ct_start_timeout_s is an error naming it."""
    ct = fresh
    assert ct.show("UnitFileState") == "enabled", "the unit must start at boot"
    converged = ct.playbook("l2_container.yml")  # a new lab has had no L2 (`make test`: molecule ran it)
    assert converged.returncode == 0, " ".join(converged.stdout.split())[-3000:]
    try:
        reboot_with_a_slow_start(ct, slow)
        run = ct.playbook("l2_container.yml", "-e", "ct_start_timeout_s=20")
        out = " ".join(run.stdout.split())
        if slow == SLOW_TRAINER:
            assert run.returncode == 0, out[-3000:]
            assert "booted; still starting (they run at every boot): dflash-train.service" in out, out[-3000:]
            recap = out.split("lab-ct200 : ok=")[-1][:40]
            assert " changed=0 " in recap, out[-600:]
            assert ct.sh("systemctl is-system-running", check=False).stdout.strip() == "starting"
            verify = ct.playbook("verify_layer.yml", "-e", '{"verify_tests": ["test_l2_container.py"]}')
            assert verify.returncode == 0, " ".join(verify.stdout.split())[-3000:]
        else:
            assert run.returncode != 0, out[-3000:]
            want = "CT 200 has not finished booting after ct_start_timeout_s=20 s: start jobs still running: "
            assert want + "zz-test-slow-boot.service" in out, out[-3000:]
    finally:
        other = os.path.basename(SLOW_OTHER)
        cleanup = f"systemctl disable --now {other}; rm -f {SLOW_TRAINER} {SLOW_OTHER}"
        ct.sh(f"{cleanup}; systemctl daemon-reload; systemctl stop dflash-train", check=False, timeout=300)
