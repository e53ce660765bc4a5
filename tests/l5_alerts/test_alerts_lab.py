"""Alerts from dflash-train.service in the lab CT, received by the lab's webhook receiver: a killed rank, an
injected CUDA OOM, a clean stop, and an unreachable webhook that leaves training untouched."""

from __future__ import annotations

import time

from tests.l5_alerts.conftest import converge_alerts, received, wait_message

START_S = 240  # preflight + imports + load on a contended 2-core machine


def start_and_wait_step(ct, step: int) -> None:
    ct.sh("systemctl start --no-block dflash-train")
    ct.wait_for(lambda: (ct.status_step() or 0) >= step, START_S, f"STATUS at step {step}")


def test_a_killed_rank_is_told_within_30_s_naming_the_rank_and_the_cause(fresh):
    ct = fresh
    start_and_wait_step(ct, 12)
    rank = ct.sh(f"pgrep -P {ct.show('MainPID')}").stdout.split()[0]  # the launcher's first child: rank 0
    t0 = time.time()
    ct.sh(f"kill -9 {rank}")
    msg = wait_message(t0, "failed", 30)
    took = msg["_at"] - t0
    assert took < 30
    assert msg["cause"]["kind"] == "rank_exit" and msg["cause"]["rank"] == 0, msg
    assert "rank 0 (target) killed by SIGKILL" in msg["text"], msg["text"]
    assert (
        msg["host"] == "lab-host" and msg["ct"] == "200 (lab-ct200)" and msg["unit"] == "dflash-train.service"
    )
    assert msg["step"] >= 10 and msg["checkpoint"]["step"] >= 10, msg
    back = wait_message(t0, "recovered", START_S)
    assert "rank 0 (target) killed by SIGKILL" in back["text"]
    print(f"\nkilled rank 0 -> message after {took:.1f} s: {msg['title']}")


def test_an_injected_cuda_oom_is_named_oom_with_its_rank(fresh):
    ct = fresh
    # distributed/failure.py's fault injection: rank 1 (the drafter) raises torch.OutOfMemoryError at step 3.
    dropin = "/run/systemd/system/dflash-train.service.d"
    ct.sh(
        f"mkdir -p {dropin} && printf '[Service]\\nEnvironment=DFLASH_FAULT=rank=1,step=3,kind=oom\\n' "
        f"> {dropin}/fault.conf && systemctl daemon-reload"
    )
    try:
        t0 = time.time()
        ct.sh("systemctl start --no-block dflash-train")
        msg = wait_message(t0, "failed", START_S)
    finally:
        ct.sh("systemctl stop dflash-train; rm -f /run/systemd/system/dflash-train.service.d/fault.conf; "
              "systemctl daemon-reload; systemctl reset-failed dflash-train", check=False)  # fmt: skip
    cause = msg["cause"]
    assert cause["kind"] == "cuda_oom" and cause["rank"] == 1 and cause["gpu"] == 0, msg
    assert msg["title"].endswith(": CUDA out of memory")
    assert "CUDA out of memory on rank 1 (drafter) on GPU 0" in msg["text"]


def test_a_stopped_run_says_it_stopped_cleanly(fresh):
    ct = fresh
    start_and_wait_step(ct, 13)
    t0 = time.time()
    ct.sh("systemctl stop dflash-train", timeout=130)
    msg = wait_message(t0, "stopped", 30)
    stopped = int(ct.journal().split("stopped at step ")[-1].split(";")[0])
    assert msg["severity"] == "info" and f"stopped cleanly at step {stopped}, checkpoint saved" in msg["text"]
    assert msg["checkpoint"]["step"] == stopped
    assert not [m for m in received(t0) if m["event"] == "failed"]


def test_an_unreachable_webhook_leaves_training_untouched(fresh):
    ct = fresh
    # The role's file, pointed at a port nobody listens on (closed: connection refused at once, then retries).
    ct.sh("printf 'http://127.0.0.1:9/unreachable-SECRET\\n' > /etc/dflash/alerts-webhook.url")
    try:
        start_and_wait_step(ct, 12)
        restarts = int(ct.show("NRestarts"))
        cursor = ct.cursor()
        rank = ct.sh(f"pgrep -P {ct.show('MainPID')}").stdout.split()[0]
        t0 = time.monotonic()
        ct.sh(f"kill -9 {rank}")
        ct.wait_for(lambda: int(ct.show("NRestarts")) > restarts, 30, "the restart")
        restart_s = time.monotonic() - t0
        before = ct.checkpoints()[-1]
        ct.wait_for(lambda: (ct.status_step() or 0) > before, START_S, "training past the checkpoint again")

        def warned() -> str | None:
            log = ct.journal(cursor, unit="dflash-alert")
            return log if "not delivered" in log else None

        log = ct.wait_for(warned, 60, "the notifier's warning")
        assert log.count("not delivered") == 1 and "after 4 attempt(s)" in log, log
        assert "SECRET" not in log and "SECRET" not in ct.journal(cursor)
        # RestartSec=1 plus the stop: the retries (1+2+4 s) are not in the restart's path.
        assert restart_s < 7, f"restarted {restart_s:.1f} s after the kill"
        # The same start: no further failure, the unit running (after its start hook, a fraction of a second).
        ct.wait_for(lambda: ct.show("ActiveState") == "active", 30, "the unit active")
        assert int(ct.show("NRestarts")) == restarts + 1
        print(f"\nwebhook unreachable: restarted {restart_s:.1f} s after the kill; {log.splitlines()[-1]}")
    finally:
        ct.sh("systemctl stop dflash-train", check=False, timeout=130)
        converge_alerts()  # the role's URL back


def test_a_stall_past_the_threshold_alerts(fresh):
    ct = fresh
    # A 10 s window (the watch checks every 2 s): shorter than the tests' WatchdogSec=20, so the stall is told
    # while the job is alive and stopped, before the watchdog would end it.
    converge_alerts("-e", "trainer_alerts_slow_minutes=0.1667")
    try:
        start_and_wait_step(ct, 12)
        target = ct.sh(f"pgrep -P {ct.show('MainPID')}").stdout.split()[0]  # rank 0: the drafter waits on it
        t0 = time.time()
        ct.sh(f"kill -STOP {target}")
        try:
            # Under the peer monitor's 15 s (a rank silent longer ends the job) and the watchdog's 20 s.
            msg = wait_message(t0, "stalled", 14)
        finally:
            ct.sh(f"kill -CONT {target}", check=False)
        assert msg["severity"] == "warning" and "no training step for 0.1667 min" in msg["text"], msg
        assert msg["_at"] - t0 < 14
        ct.wait_for(lambda: ct.show("ActiveState") == "active", 30, "the unit still running")
        assert int(ct.show("NRestarts")) == 0
    finally:
        ct.sh("systemctl stop dflash-train", check=False, timeout=130)
        converge_alerts()


def test_a_preflight_failure_names_the_check_and_the_start_limit_gives_up(fresh):
    ct = fresh
    burst = int(ct.show("StartLimitBurst"))
    ct.sh("rm /var/lib/dflash-svc-test/model/model.safetensors")
    try:
        t0 = time.time()
        ct.sh("systemctl start --no-block dflash-train")
        first = wait_message(t0, "failed", 60)
        assert first["cause"]["kind"] == "preflight" and first["cause"]["check"] == "model", first
        assert (
            "preflight check model failed" in first["text"] and "model.safetensors: missing" in first["text"]
        )
        # systemd 252 starts the OnFailure= unit once the start limit is hit: "gave up" after BURST failures.
        gave = wait_message(t0, "gave_up", 30 + burst * 15)
        assert gave["cause"]["kind"] == "start_limit" and gave["severity"] == "critical", gave
        assert (
            f"failed {burst} times within" in gave["text"] and "preflight check model failed" in gave["text"]
        )
        assert ct.show("ActiveState") == "failed"
        failed = [m for m in received(t0) if m["event"] == "failed"]
        assert len(failed) == burst, [m["title"] for m in failed]  # one message per failure, none twice
    finally:
        ct.sh("systemctl reset-failed dflash-train", check=False)
        ct.stage_data()
