"""One job on two lab CTs (inventory/lab-multinode): each CT's own dflash-train.service as
roles/training_job and roles/trainer_service installed it, one rank each over gloo on loopback addresses,
checkpoints on the shared storage that roles/pve_container binds into both. Start, READY on both, the
leader's STATUS, a graceful stop from the leader's CT (one checkpoint, both units end as success), the
resume on both, a node's unit killed (the other CT's unit fails within seconds naming it), systemd's restart
of both and the resume after it."""

from __future__ import annotations

import re
import time

from tests.l5_service import lab
from tests.multinode.conftest import CHECKPOINTS, SHARED, TRAINER

START_S = 300  # both units' preflight, imports and load on a contended 2-core machine


def active(ct: str) -> bool:
    return lab.show("ActiveState", ct=ct) == "active"


def leader_ct(cts) -> str | None:
    """The CT whose unit's STATUS carries the loss: the drafter leader's."""
    return next((ct for ct in cts if lab.is_leader_status(lab.show("StatusText", ct=ct))), None)


def stop_from_leader(cts) -> None:
    """`systemctl stop` on the leader's CT; both units end as success ("failed" would stay failed)."""
    lab.sh(
        "systemctl stop dflash-train",
        ct=lab.wait_for(lambda: leader_ct(cts), 60, "the leader's STATUS"),
        timeout=180,
    )
    lab.wait_for(
        lambda: all(lab.show("ActiveState", ct=ct) == "inactive" for ct in cts), 60, "both units to end"
    )


def start_both(cts) -> None:
    for ct in cts:
        lab.sh("systemctl start --no-block dflash-train", ct=ct)
    for ct in cts:
        lab.wait_for(lambda c=ct: active(c), START_S, f"dflash-train READY in {ct}")


def checkpoints(ct: str) -> list[int]:
    return lab.checkpoints(CHECKPOINTS, ct=ct, user=TRAINER)


def test_the_shared_storage_is_one_directory_in_both_cts(cts) -> None:
    a, b = cts
    lab.sh(f"echo from-{a} > {SHARED}/probe-{a}", ct=a, user=TRAINER)
    try:
        assert lab.sh(f"cat {SHARED}/probe-{a}", ct=b, user=TRAINER).stdout.strip() == f"from-{a}"
    finally:
        lab.sh(f"rm -f {SHARED}/probe-{a}", ct=a, user=TRAINER)


def test_the_cts_root_is_a_plain_user_on_the_shared_storage(cts) -> None:
    """As on NFS (lab/nfs_standin.py): the CT's root (host uid 100000) may not write in the trainer's
    directory nor give a file away, whatever its capabilities in the CT."""
    refused = lab.sh(f"touch {SHARED}/root-probe", ct=cts[0], check=False)
    assert refused.returncode != 0 and "Permission denied" in refused.stderr, refused.stderr
    refused = lab.sh(f"chown root {SHARED}", ct=cts[0], check=False)
    assert refused.returncode != 0 and "Operation not permitted" in refused.stderr, refused.stderr


def test_two_cts_ready_stop_resume_and_a_node_killed(job) -> None:
    cts = job
    cursors = {ct: lab.cursor(ct) for ct in cts}
    start_both(cts)
    for ct in cts:
        lab.wait_for(
            lambda c=ct: lab.show("StatusText", ct=c).startswith("step"), 120, f"a step in {ct}'s STATUS"
        )
    statuses = {ct: lab.show("StatusText", ct=ct) for ct in cts}
    leader = next(ct for ct in cts if lab.is_leader_status(statuses[ct]))
    other = next(ct for ct in cts if ct != leader)
    assert "the job's leader reports loss" in statuses[other], statuses
    started = {ct: lab.journal(cursors[ct], ct=ct) for ct in cts}
    for ct in cts:  # every node's journal names its node and ranks
        assert re.search(r"node \d launcher: node \d \(\S+, ranks? \d", started[ct]), started[ct]

    # `systemctl stop` on the leader's CT: one checkpoint, both units end as success.
    t0 = time.monotonic()
    lab.sh("systemctl stop dflash-train", ct=leader, timeout=180)
    lab.wait_for(lambda: not active(other), 60, f"{other}'s unit to end")
    stop_s = time.monotonic() - t0
    assert [lab.show("ActiveState", ct=ct) for ct in cts] == ["inactive", "inactive"]  # failed stays "failed"
    log = lab.journal(cursors[leader], ct=leader)
    assert "stopped at step" in log, log
    step = int(log.split("stopped at step ")[1].split(";")[0])
    assert checkpoints(other)[-1] == step, (step, checkpoints(other))  # the other CT sees the stop's save
    print(f"\nstopped at step {step}: both units ended {stop_s:.1f} s after `systemctl stop` on {leader}")

    # Both again: they resume from it; then node 1's unit is killed whole and node 0's fails naming it.
    cursors = {ct: lab.cursor(ct) for ct in cts}
    start_both(cts)
    resumed = f"resumed from {CHECKPOINTS}/step-{step:08d} (step {step})"
    lab.wait_for(lambda: any(resumed in lab.journal(cursors[ct], ct=ct) for ct in cts), 60, "the resume line")
    nodes = {
        ct: int(re.search(r"node (\d) launcher: node \d \(", lab.journal(cursors[ct], ct=ct)).group(1))
        for ct in cts
    }
    victim = next(ct for ct in cts if nodes[ct] == 1)
    survivor = next(ct for ct in cts if ct != victim)
    restarts = {ct: int(lab.show("NRestarts", ct=ct)) for ct in cts}
    killed = {ct: lab.cursor(ct) for ct in cts}
    t0 = time.monotonic()
    lab.sh("systemctl kill -s SIGKILL --kill-whom=all dflash-train", ct=victim)
    lab.wait_for(
        lambda: int(lab.show("NRestarts", ct=survivor)) > restarts[survivor], 60, f"{survivor} to fail"
    )
    took = time.monotonic() - t0
    log = lab.journal(killed[survivor], ct=survivor)
    assert re.search(r"node 1 \(\S+, rank 1\) lost", log), log
    assert took < 30, f"{took:.1f} s"
    print(f"{victim}'s unit killed: {survivor}'s unit failed {took:.1f} s later, naming node 1")

    # Restart=on-failure starts both again; they meet in the rendezvous and resume from the newest checkpoint.
    newest = checkpoints(survivor)[-1]
    assert int(lab.show("NRestarts", ct=victim)) > restarts[victim]
    for ct in cts:
        lab.wait_for(lambda c=ct: active(c), START_S, f"{ct} READY again")
    resumed = f"resumed from {CHECKPOINTS}/step-{newest:08d} (step {newest})"
    lab.wait_for(
        lambda: any(resumed in lab.journal(killed[ct], ct=ct) for ct in cts), 60, "the resume after the kill"
    )
    stop_from_leader(cts)
    print(f"both restarted by systemd, resumed at step {newest}, stopped as success")


def test_a_node_rebooted_stops_the_job_with_a_checkpoint_and_it_resumes_when_back(job) -> None:
    """A CT's host shutting down (here the CT's own `systemctl reboot`: systemd stops the unit as a host's
    shutdown does) stops the job gracefully with one checkpoint; the other CT's unit fails naming the node
    that left, systemd restarts it to wait in the rendezvous, the rebooted CT's enabled unit starts at boot,
    and the job resumes on both from the checkpoint of the shutdown."""
    cts = job
    cursors = {ct: lab.cursor(ct) for ct in cts}
    start_both(cts)
    lab.wait_for(lambda: leader_ct(cts), 120, "a step in the leader's STATUS")
    rebooted, other = cts[1], cts[0]
    assert lab.show("UnitFileState", ct=rebooted) == "enabled", "the unit must start at boot"
    restarts = int(lab.show("NRestarts", ct=other))
    lab.sh("systemctl reboot", ct=rebooted, check=False)  # the attach may end with the container's shutdown
    t0 = time.monotonic()
    lab.wait_for(lambda: int(lab.show("NRestarts", ct=other)) > restarts, 120, f"{other}'s unit to restart")
    log = lab.journal(cursors[other], ct=other)
    assert re.search(
        rf"node \d \({rebooted}, rank \d\) left: its host {rebooted} is shutting down or rebooting", log
    ), log
    print(
        f"\n{other}'s unit restarted {time.monotonic() - t0:.1f} s after the reboot of {rebooted}, naming it"
    )

    def booted() -> bool:
        return lab.sh("systemctl is-system-running", ct=rebooted, check=False).stdout.strip() in (
            "running",
            "degraded",
        )

    lab.wait_for(booted, 300, f"{rebooted} to boot again", interval=2)
    for ct in cts:
        lab.wait_for(lambda c=ct: active(c), START_S, f"{ct} READY after the reboot")
    # The drafter leader's line of the shutdown's save, on whichever CT it ran (journals outlive the reboot).
    stops = re.findall(r"stopped at step (\d+);", "".join(lab.journal(cursors[ct], ct=ct) for ct in cts))
    assert len(stops) == 1, stops
    saved = int(stops[0])
    resumed = f"resumed from {CHECKPOINTS}/step-{saved:08d} (step {saved})"
    lab.wait_for(lambda: any(resumed in lab.journal(cursors[ct], ct=ct) for ct in cts), 60, "the resume line")
    print(f"{rebooted} back: the job resumed at step {saved}, the checkpoint of its shutdown")
    stop_from_leader(cts)


def test_the_alerts_watch_reads_the_shared_checkpoints(cts) -> None:
    """dflash-alert-watch (roles/trainer_alerts, root in the CT) reads the job's checkpoint directory for its
    checkpoint metrics. On NFS the CT's root is a plain user: it reads as a member of the trainer's group, so
    the trainer's checkpoints (written with its unit's UMask) must be readable by that group."""
    ct = cts[0]
    step = f"{CHECKPOINTS}/step-90000007"  # newer than any checkpoint an earlier test left
    umask = lab.show("UMask", ct=ct)
    props = f"-p User={TRAINER} -p UMask={umask}"
    lab.sh(f"systemd-run --quiet --wait {props} /bin/sh -c 'mkdir {step} && echo x > {step}/model.pt'", ct=ct)
    prom = "/var/lib/prometheus/node-exporter/dflash_train.prom"

    def checkpoint_step() -> str | None:
        out = lab.sh(f"grep '^dflash_train_checkpoint_step{{' {prom}", ct=ct, check=False).stdout.split()
        return out[-1] if out else None

    try:
        lab.wait_for(lambda: checkpoint_step() == "90000007", 60, f"checkpoint step 90000007 in {prom}")
    finally:
        lab.sh(f"rm -rf {step}", ct=ct, user=TRAINER)
