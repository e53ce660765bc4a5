"""Bad inventory values stop the L4 play in its preflight, before anything changes, with one line naming the
variable and the host."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.data.conftest import REPO


def play(*extra_vars: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "ANSIBLE_CONFIG": str(REPO / "ansible" / "ansible.cfg"),
        "PATH": f"{REPO / '.venv' / 'bin'}:{os.environ['PATH']}",
        "ANSIBLE_NOCOLOR": "1",
    }
    argv = [str(REPO / ".venv/bin/ansible-playbook"), "-i", "inventory/lab", "ansible/l4_data.yml"]
    for ev in extra_vars:
        argv += ["-e", ev]
    return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False)


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (
            ["s3_shards_uri=dflash-lab/shards"],
            "lab-ct200: shard_sync_source (s3_shards_uri) = dflash-lab/shards must be s3://BUCKET/PREFIX/",
        ),
        (
            ["data_shards_dir=/var"],
            "lab-ct200: shard_sync_dest (data_shards_dir) = /var must be an absolute path",
        ),
    ],
)
def test_bad_value_is_named_before_anything_changes(extra: list[str], expected: str) -> None:
    proc = play(*extra)
    assert proc.returncode != 0
    assert expected in proc.stdout, proc.stdout[-2000:]
    assert "changed=0" in proc.stdout
