"""One job on two nodes under the lab container's real systemd: two units (transient, with the properties of
dflash-train.service) each running `dflash-train launch --nnodes 2 --rdzv-endpoint 127.0.0.1:PORT` over the
tests' trainer environment and tiny data (tests/l5_service/lab.py), one rank each over gloo, one checkpoint
directory. Both units reach READY through systemd's notify socket, the leader's STATUS carries the loss,
`systemctl stop` on the leader's unit stops both as success with one checkpoint, both resume from it, and a
node killed (`systemctl kill -s SIGKILL`, its whole cgroup) fails the other unit within seconds, naming it.

Both nodes live in one container here (the lab's containers share the host's network, so a second one would
add a second systemd, not a second network); what a second CT adds is roles/training_job's part, tested on its
own (test_training_job_firewall.py, test_multinode_render.py)."""

from __future__ import annotations

import re
import time

import pytest

from tests.l5_service.lab import is_leader_status

pytestmark = pytest.mark.slow

START_S = 300  # two units' preflight-less start, imports and load on a contended 2-core machine
JOB = "/var/lib/dflash-svc-test/job"
UNITS = ("dflash-node-a", "dflash-node-b")
PORT = 29455


def start(ct, unit: str) -> None:
    props = [
        "Type=notify",
        "NotifyAccess=all",
        "KillMode=mixed",
        "WatchdogSec=20",
        "TimeoutStopSec=120",
        "SyslogIdentifier=dflash-train",
        "Restart=on-failure",
        "RestartSec=1",
    ]
    cmd = ["systemd-run", "--no-block", f"--unit={unit}", *(f"-p {p}" for p in props)]
    cmd += ["-E PYTHONUNBUFFERED=1", "-E TQDM_DISABLE=1", "-E OMP_NUM_THREADS=1"]
    cmd += ["/opt/dflash-svc-test/venv/bin/python -m dflash_trainer.service launch --nnodes 2"]
    cmd += [f"--nproc-per-node 1 --rdzv-endpoint 127.0.0.1:{PORT} --rdzv-id labjob --local-addr 127.0.0.1"]
    cmd += [f"-- serve {JOB}/train.toml"]
    ct.sh(" ".join(cmd))


def start_both(ct) -> None:
    for unit in UNITS:
        start(ct, unit)
        time.sleep(0.5)  # the rendezvous numbers nodes by (address, pid): a first, usually
    for unit in UNITS:
        ct.wait_for(lambda u=unit: ct.show("ActiveState", u) == "active", START_S, f"{unit} READY")


def clean(ct) -> None:
    ct.sh(
        " ; ".join(f"systemctl stop {u} 2>/dev/null; systemctl reset-failed {u} 2>/dev/null" for u in UNITS),
        check=False,
    )


def node_of(ct, unit: str, cursor: str) -> int:
    found = re.search(r"node (\d) launcher: node \d \(", ct.journal(cursor, unit))
    assert found, ct.journal(cursor, unit)
    return int(found.group(1))


@pytest.fixture
def job(ct):
    clean(ct)
    ct.sh(
        f"rm -rf {JOB} && mkdir -p {JOB} && "
        f"sed 's#^checkpoint_dir = .*#checkpoint_dir = \"{JOB}/checkpoints\"#' /etc/dflash/train.toml "
        f"> {JOB}/train.toml && grep -q '{JOB}/checkpoints' {JOB}/train.toml"
    )
    yield ct
    clean(ct)
    ct.sh(f"rm -rf {JOB}", check=False)


def job_checkpoints(ct) -> list[int]:
    return ct.checkpoints(f"{JOB}/checkpoints")


def test_two_nodes_ready_stop_resume_and_a_node_killed(job):
    ct = job
    cursor = ct.cursor()
    start_both(ct)
    for unit in UNITS:
        ct.wait_for(
            lambda u=unit: ct.show("StatusText", u).startswith("step"), 60, f"a step in {unit}'s STATUS"
        )
    statuses = {u: ct.show("StatusText", u) for u in UNITS}
    leader = next(u for u in UNITS if is_leader_status(statuses[u]))
    other = next(u for u in UNITS if u != leader)
    assert "the job's leader reports loss" in statuses[other], statuses

    # `systemctl stop` on the leader's unit: one checkpoint, both units end as success.
    t0 = time.monotonic()
    ct.sh(f"systemctl stop {leader}", timeout=130)
    ct.wait_for(lambda: ct.show("ActiveState", other) != "active", 60, f"{other} to end")
    stop_s = time.monotonic() - t0
    assert [ct.show("ActiveState", u) for u in UNITS] == ["inactive", "inactive"]  # failed ones stay "failed"
    log = ct.journal(cursor, leader)
    assert "stopped at step" in log and "all 1 rank(s) stopped cleanly" in log, log
    assert re.search(r"all 1 rank\(s\) (finished|stopped) cleanly", ct.journal(cursor, other))
    step = int(log.split("stopped at step ")[1].split(";")[0])
    assert job_checkpoints(ct)[-1] == step, (step, job_checkpoints(ct))  # the stop's save is the newest
    print(f"\nstopped at step {step}: both units ended {stop_s:.1f} s after `systemctl stop` of the leader's")

    # Both again: they resume from it; then node 1's unit is killed whole and node 0's fails naming it.
    cursor = ct.cursor()
    start_both(ct)
    resumed = f"resumed from {JOB}/checkpoints/step-{step:08d} (step {step})"
    ct.wait_for(lambda: any(resumed in ct.journal(cursor, u) for u in UNITS), 60, "the resume line")
    victim = next(u for u in UNITS if node_of(ct, u, cursor) == 1)
    survivor = next(u for u in UNITS if u != victim)
    restarts = {u: int(ct.show("NRestarts", u)) for u in UNITS}
    killed = ct.cursor()
    t0 = time.monotonic()
    ct.sh(f"systemctl kill -s SIGKILL --kill-whom=all {victim}")
    ct.wait_for(lambda: int(ct.show("NRestarts", survivor)) > restarts[survivor], 60, f"{survivor} to fail")
    took = time.monotonic() - t0
    log = ct.journal(killed, survivor)
    assert re.search(r"node 1 \(\S+, rank 1\) lost", log), log
    assert took < 30, f"{took:.1f} s"
    print(f"node 1's unit killed: node 0's unit failed {took:.1f} s later, naming it")

    # Restart=on-failure starts both again; they meet in the rendezvous and the job resumes from the newest
    # checkpoint by itself. A stop from the leader's unit then ends both as success.
    newest = job_checkpoints(ct)[-1]
    assert int(ct.show("NRestarts", victim)) > restarts[victim]
    for unit in UNITS:
        ct.wait_for(lambda u=unit: ct.show("ActiveState", u) == "active", START_S, f"{unit} READY again")
    resumed = f"resumed from {JOB}/checkpoints/step-{newest:08d} (step {newest})"
    ct.wait_for(lambda: any(resumed in ct.journal(killed, u) for u in UNITS), 60, "the resume after the kill")
    leader = next(u for u in UNITS if f"{resumed}" in ct.journal(killed, u))
    ct.sh(f"systemctl stop {leader}", timeout=130)
    ct.wait_for(lambda: all(ct.show("ActiveState", u) == "inactive" for u in UNITS), 60, "both units to end")
    print(f"both restarted by systemd, resumed at step {newest}, stopped as success")
