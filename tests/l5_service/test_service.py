"""dflash-train.service under the lab container's real systemd, with the two ranks of the lab's 1:1 topology
(the N:M service a GPU host runs): READY and STATUS, a killed rank, a stop, a hang, a broken machine caught by
preflight, and a tracker that fails mid-run."""

from __future__ import annotations

import json
import time

import pytest

START_S = 240  # preflight + imports + load on a contended 2-core machine


def start_and_wait_step(ct, step: int) -> None:
    ct.sh("systemctl start --no-block dflash-train")
    ct.wait_for(lambda: (ct.status_step() or 0) >= step, START_S, f"STATUS at step {step}")


def test_start_reaches_ready_and_status_shows_the_step(fresh):
    ct = fresh
    t0 = time.monotonic()
    ct.sh("systemctl start dflash-train", timeout=START_S)  # Type=notify: returns once READY=1 arrived
    ready_s = time.monotonic() - t0
    assert ct.show("ActiveState") == "active" and ct.show("SubState") == "running"
    step = ct.wait_for(ct.status_step, 60, "a STATUS line with the step")
    text = ct.show("StatusText")
    assert "loss" in text and "tok/s" in text, text

    # Two ranks (the lab's [topology] is 1:1): rank 0 the target, rank 1 the drafter that speaks to systemd.
    # Every rank line carries its rank and role. The first step line comes at log_every (10), after the first
    # STATUS (status_every: 5), and journald may lag behind systemd's status: wait for it.
    def journal_with_a_step_line() -> str | None:
        log = ct.journal()
        return log if "rank 1 drafter: step" in log else None

    log = ct.wait_for(journal_with_a_step_line, 60, "a step line in the journal")
    assert "launcher: started 2 rank(s)" in log and "rank 0 target: " in log
    assert "ready: target, drafter, data and the newest checkpoint loaded on every rank" in log
    assert "start: interpreter, imports, configuration" in log  # where the start's seconds went, per rank
    assert "Unable to resolve hostname" not in log  # gloo told to use loopback, not to warn and fall back
    print(f"\nREADY after {ready_s:.1f} s; STATUS: {text!r} (step {step})")


def test_kill_minus_9_of_a_rank_restarts_and_resumes(fresh):
    ct = fresh
    start_and_wait_step(ct, 25)
    before = ct.checkpoints()[-1]
    restarts = int(ct.show("NRestarts"))
    rank = ct.sh(f"pgrep -P {ct.show('MainPID')}").stdout.split()[0]
    cursor = ct.cursor()
    ct.sh(f"kill -9 {rank}")
    ct.wait_for(lambda: int(ct.show("NRestarts")) > restarts, 30, "the restart")
    ct.wait_for(lambda: "resumed from" in ct.journal(cursor), START_S, "the resume")
    log = ct.journal(cursor)
    assert "rank 0 killed by SIGKILL" in log
    resumed = next(line for line in log.splitlines() if "resumed from" in line)
    step = int(resumed.rsplit("step ", 1)[1].rstrip(")"))
    assert step >= before > 0, (before, resumed)  # the newest checkpoint at the kill, not zero
    print(f"\nkilled at >= step {before}; {resumed}")


def test_systemctl_stop_saves_a_checkpoint_and_ends_as_success(fresh):
    ct = fresh
    start_and_wait_step(ct, 13)  # checkpoint_every = 10: the stop's save is a step of its own
    cursor = ct.cursor()
    t0 = time.monotonic()
    ct.sh("systemctl stop dflash-train", timeout=130)
    stop_s = time.monotonic() - t0
    log = ct.journal(cursor)
    assert ct.show("ActiveState") == "inactive" and ct.show("Result") == "success", log
    assert "saving a checkpoint after this step" in log and "stopped at step" in log
    stopped = int(log.split("stopped at step ")[1].split(";")[0])
    assert stopped in ct.checkpoints(), (stopped, ct.checkpoints())
    print(f"\nstopped at step {stopped} in {stop_s:.1f} s; checkpoints {ct.checkpoints()}")


def test_a_hung_rank_is_ended_by_the_watchdog_and_restarted(fresh):
    ct = fresh
    start_and_wait_step(ct, 5)
    watchdog_s = int(ct.show("WatchdogUSec").rstrip("s"))
    restarts = int(ct.show("NRestarts"))
    rank = ct.sh(f"pgrep -P {ct.show('MainPID')}").stdout.split()[0]
    cursor = ct.cursor()
    ct.sh(f"kill -STOP {rank}")
    t0 = time.monotonic()
    ct.wait_for(lambda: int(ct.show("NRestarts")) > restarts, watchdog_s + 30, "the watchdog's restart", 0.25)
    took = time.monotonic() - t0
    log = ct.journal(cursor)
    assert "Watchdog timeout" in log, log
    assert took <= watchdog_s + 10, f"restarted {took:.1f} s after the hang, WatchdogSec={watchdog_s}"
    assert ct.sh(f"test -d /proc/{rank}", check=False).returncode != 0, (
        "the stopped rank outlived the launcher"
    )
    print(f"\nhang -> restart in {took:.1f} s (WatchdogSec={watchdog_s})")


@pytest.mark.parametrize(
    ("damage", "expect"),
    [
        (
            "rm /var/lib/dflash-svc-test/model/model.safetensors",
            ["FAIL model:", "model.safetensors: missing"],
        ),
        (
            "truncate -s 1000 /var/lib/dflash-svc-test/shards/shard-00001.arrow",
            ["FAIL shards:", "shard-00001.arrow"],
        ),
    ],
    ids=["model-file-removed", "shard-truncated"],
)
def test_preflight_names_each_failure_before_any_model_loads(fresh, damage, expect):
    ct = fresh
    try:
        ct.sh(damage)
        t0 = time.monotonic()
        proc = ct.sh(
            "/opt/dflash-svc-test/venv/bin/python -m dflash_trainer.service preflight --json "
            "/etc/dflash/train.toml",
            check=False,
        )
        took = time.monotonic() - t0
        assert proc.returncode == 1
        report = json.loads(proc.stdout)
        failed = [c for c in report["checks"] if not c["ok"]]
        line = " ".join(f"FAIL {c['name']}: {c['detail']} -- fix: {c['fix']}" for c in failed)
        assert len(failed) == 1 and all(e in line for e in expect), line
        assert failed[0]["fix"], "each failure names its fix"
        # Through the unit: ExecStartPre fails it and the trainer never starts loading.
        cursor = ct.cursor()
        ct.sh("systemctl start dflash-train", check=False, timeout=120)
        log = ct.journal(cursor)
        assert "control process exited" in log or "Control process exited" in log, log
        assert "launcher: started" not in log and "ready:" not in log
        print(f"\n{line} ({report['seconds']:.1f} s in preflight, {took:.1f} s wall)")
    finally:
        ct.sh("systemctl stop dflash-train; systemctl reset-failed dflash-train", check=False)
        ct.converge()  # the role's configuration back


def test_a_wrong_tracker_setting_is_a_warning_and_the_unit_trains(fresh):
    """A tracker never stops training: preflight warns (exit 0) and the unit starts and steps."""
    ct = fresh
    try:
        ct.sh("sed -i 's|^tensorboard = .*|wandb_project = \"team/drafters\"|' /etc/dflash/train.toml")
        proc = ct.sh(
            "/opt/dflash-svc-test/venv/bin/python -m dflash_trainer.service preflight --json "
            "/etc/dflash/train.toml",
            check=False,
        )
        assert proc.returncode == 0, proc.stdout[-2000:]
        checks = json.loads(proc.stdout)["checks"]
        warned = [c for c in checks if c.get("warned")]
        assert [c["name"] for c in warned] == ["trackers"], checks
        assert "trackers.wandb_project" in warned[0]["detail"], warned[0]
        start_and_wait_step(ct, 3)
    finally:
        ct.sh("systemctl stop dflash-train; systemctl reset-failed dflash-train", check=False)
        ct.converge()


def test_a_tracker_failing_mid_run_warns_once_and_training_goes_on(fresh):
    """The lab has no tracker server; the tensorboard log directory on a 64 KiB tmpfs fills up mid-run,
    which is what a tracker whose backend went away looks like to the trainer: its writes start failing."""
    ct = fresh
    tb = "/var/lib/dflash-svc-test/train/tensorboard"
    ct.sh(f"mkdir -p {tb} && mount -t tmpfs -o size=64k tmpfs {tb}")
    try:
        cursor = ct.cursor()
        start_and_wait_step(ct, 5)
        ct.sh(f"dd if=/dev/zero of={tb}/filler bs=4k count=64 2>/dev/null || true")
        # The event file's last page still has room for a few small appends: top it up too, so the
        # tracker's next flush meets a full device (ENOSPC), as a writer whose backend went away would.
        ct.sh(f"for f in {tb}/events.out.tfevents.*; do cat /dev/zero >> $f 2>/dev/null; done; true")
        step = ct.status_step()
        ct.wait_for(lambda: (ct.status_step() or 0) >= step + 30, 120, "30 more steps")
        log = ct.journal(cursor)
        warnings = [line for line in log.splitlines() if "tracker tensorboard failed" in line]
        assert len(warnings) == 1, warnings
        assert ct.show("ActiveState") == "active" and int(ct.show("NRestarts")) == 0
        print(f"\n{warnings[0]}")
    finally:
        ct.sh(f"systemctl stop dflash-train; umount {tb}", check=False)


def test_the_smoke_run_preflights_as_the_unit_does_into_its_cache_directory(fresh):
    """dflash-smoke's preflight runs as the unit's ExecStartPre does (the trainer's user, the unit's sandbox)
    with its CacheDirectory=, so the kernels and verdicts its GPU probes keep are the ones the unit's first
    start after `make smoke-train` finds (its caches line names them; on CPU nothing is compiled)."""
    ct = fresh
    run = ct.sh("DFLASH_SMOKE_STEPS=12 DFLASH_SMOKE_STOP_AT=6 dflash-smoke", check=False, timeout=3 * START_S)
    out = run.stdout + run.stderr
    assert run.returncode == 0 and out.rstrip().endswith("PASS"), out[-4000:]
    caches = next((line for line in out.splitlines() if " caches: " in line), None)
    assert caches is not None, out[-4000:]
    cache = "/var/cache/dflash-train"
    assert f"triton {cache}/triton (" in caches and f"inductor {cache}/inductor (" in caches, caches
    assert f"probe verdicts {cache}/dflash-preflight/probe-verdicts.json" in caches, caches
