"""A reboot of CT 200 with the two-rank job running: systemd stops the unit (SIGTERM: each rank finishes its
step, the drafter saves), the container boots, the enabled unit starts again and resumes at the saved step."""

from __future__ import annotations

import time

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
