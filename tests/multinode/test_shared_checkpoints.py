"""roles/trainer_service on the two-CT lab: a multi-node job's checkpoint directory, on shared storage, is
made and probed by the trainer's own user. One the trainer's user cannot write is refused in one line naming
the directory, its owner, the trainer's uid and the fix. The lab's shared storage is an NFS export
(lab/nfs_standin.py), where the CT's root could not stand in for the trainer."""

from __future__ import annotations

import os
import shutil
import subprocess

from lab.settings import REPO, load_settings
from lab.shared_storage import export_dir
from tests.multinode.conftest import SHARED, TRAINER

INVENTORY = REPO / "inventory" / "lab-multinode"
CT_ROOT = 100000  # an unprivileged CT's root as a host uid (pve-container's default id map)


def l5_check(ct: str, checkpoint_dir: str) -> subprocess.CompletedProcess[str]:
    """The trainer_service role in check mode on one CT, with another training_job_checkpoint_dir."""
    argv = [str(REPO / ".venv" / "bin" / "ansible-playbook"), "-i", str(INVENTORY)]
    argv += [str(REPO / "ansible" / "l5_service.yml"), "--limit", ct, "--tags", "trainer_service", "--check"]
    argv += ["-e", f"training_job_checkpoint_dir={checkpoint_dir}"]
    env = {**os.environ, "ANSIBLE_CONFIG": str(REPO / "ansible" / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1"}
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600, check=False, cwd=REPO)


def test_a_shared_directory_of_the_cts_root_is_refused_for_the_trainer(cts) -> None:
    """A directory the CT's root owns (what `ct_uid: 0` made) is not the trainer's on NFS."""
    host_side = export_dir(load_settings(INVENTORY)) / "roots"
    host_side.mkdir(mode=0o755)
    os.chown(host_side, CT_ROOT, CT_ROOT)
    try:
        run = l5_check(cts[0], f"{SHARED}/roots/checkpoints")
        out = " ".join((run.stdout + run.stderr).split())  # Ansible's YAML output folds long messages
        assert run.returncode != 0, out[-3000:]
        tail = out[-3000:]
        assert f"the trainer ({TRAINER}, uid 2000) cannot create a file in {SHARED}/roots (" in out, tail
        assert "Permission denied" in out and "owner uid 0" in out, tail
        assert "ct_uid: 2000 in ct_mount_points" in out, tail
        assert list(host_side.iterdir()) == [], "the check left something behind"
    finally:
        shutil.rmtree(host_side)
