"""Fixtures of the L4 behaviour tests: the lab's CT 200 stand-in with the L4 roles converged against the
test bucket (tests/l4_data/s3data.py), and a shell in it. Each test works in directories of its own under
/var/tmp/l4test and /dev/shm/l4test, so the deployed shards and staged model stay as the roles left them."""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

import pytest

from tests.l4_data import s3data

REPO = Path(__file__).resolve().parents[2]
CT = "lab-ct200"
SYNC = "/usr/local/sbin/dflash-s3-sync"
STAGE = "/usr/local/sbin/dflash-stage-model"
SHARDS_CONFIG = "/etc/dflash/shards.sync.json"
WORK = "/var/tmp/l4test"
SHM_WORK = "/dev/shm/l4test"


def ct(script: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Runs a shell script in the container; never raises on a non-zero exit."""
    return subprocess.run(
        ["lxc-attach", "-n", CT, "--", "/bin/sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def ct_ok(script: str, timeout: float = 300) -> str:
    proc = ct(script, timeout)
    assert proc.returncode == 0, (
        f"{script!r}: exit {proc.returncode}: {(proc.stderr or proc.stdout).strip()[-800:]}"
    )
    return proc.stdout


def _deployed_matches_repo() -> bool:
    for local, remote in (
        (REPO / "roles/shard_sync/files/dflash_s3_sync.py", SYNC),
        (REPO / "roles/model_stage/files/dflash_stage_model.py", STAGE),
        (REPO / "roles/shard_sync/files/dflash_manifest.py", str(Path(SYNC).parent / "dflash_manifest.py")),
    ):
        digest = hashlib.sha256(local.read_bytes()).hexdigest()
        if ct(f"sha256sum {remote}").stdout.split()[:1] != [digest]:
            return False
    return (
        ct(f"grep -q dflash-l4-test {SHARDS_CONFIG} && systemctl is-active dflash-stage-model").returncode
        == 0
    )


def converge_l4() -> subprocess.CompletedProcess[str]:
    """ansible-playbook molecule/l4-data/converge.yml: L4 against the test bucket, output captured."""
    env = {
        **os.environ,
        "ANSIBLE_CONFIG": str(REPO / "ansible" / "ansible.cfg"),
        "PATH": f"{REPO / '.venv' / 'bin'}:{os.environ['PATH']}",
        "ANSIBLE_NOCOLOR": "1",
    }
    return subprocess.run(
        [str(REPO / ".venv/bin/ansible-playbook"), "-i", "inventory/lab", "molecule/l4-data/converge.yml"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )


@pytest.fixture(scope="session")
def converged() -> None:
    """Seeds the test bucket and converges L4 onto it (skipped when the container runs these tools)."""
    s3data.seed()
    if not _deployed_matches_repo():
        proc = converge_l4()
        assert proc.returncode == 0, proc.stdout[-3000:]


@pytest.fixture
def work(converged) -> str:
    ct_ok(f"rm -rf {WORK} {SHM_WORK} && mkdir -p {WORK}")
    yield WORK
    ct(f"rm -rf {WORK} {SHM_WORK}")


def sync(
    dest: str, *extra: str, source: str | None = None, pin: str | None = None
) -> subprocess.CompletedProcess[str]:
    """The deployed sync with the lab's settings; another source needs the pin of its own manifest."""
    src = f"--source {source}" if source else ""
    if pin:
        src += f" --manifest-sha256 {pin}"
    return ct(f"{SYNC} --config {SHARDS_CONFIG} {src} --dest {dest} --progress-s 1 {' '.join(extra)}")
