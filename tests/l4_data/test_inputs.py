"""Bad inventory values stop the L4 play in its preflight, before anything changes, with one line naming the
variable and the host."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.l4_data.conftest import REPO, ct_ok


def play(*extra_vars: str, tags: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "ANSIBLE_CONFIG": str(REPO / "ansible" / "ansible.cfg"),
        "PATH": f"{REPO / '.venv' / 'bin'}:{os.environ['PATH']}",
        "ANSIBLE_NOCOLOR": "1",
    }
    argv = [str(REPO / ".venv/bin/ansible-playbook"), "-i", "inventory/lab", "ansible/l4_data.yml"]
    for ev in extra_vars:
        argv += ["-e", ev]
    if tags:
        argv += ["--tags", tags]
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
        (
            ["shard_sync_manifest_sha256=CHANGE-ME"],
            "lab-ct200: shard_sync_manifest_sha256 = CHANGE-ME must be the sha256 of s3://dflash-lab/shards/MANIFEST.json",
        ),
        (
            ["model_stage_manifest_sha256=CHANGE-ME"],
            "lab-ct200: model_stage_manifest_sha256 = CHANGE-ME must be the sha256 of "
            "s3://dflash-lab/models/tiny-qwen3_5/MANIFEST.json",
        ),
    ],
)
def test_bad_value_is_named_before_anything_changes(extra: list[str], expected: str) -> None:
    proc = play(*extra)
    assert proc.returncode != 0
    assert expected in proc.stdout, proc.stdout[-2000:]
    assert "changed=0" in proc.stdout


SHARDS = "/var/lib/dflash/shards"


def test_a_manifest_that_is_not_the_pinned_one_stops_l4_and_the_shards_stay(converged) -> None:
    """The lab's bucket against another pin (what a manifest rewritten in the bucket looks like to L4): the
    play stops on one line naming the manifest's URI, its sha256 and the pin, and the synced shards and the
    trainer's pin are as they were. A second play with the inventory's pin puts the settings back."""
    before = ct_ok(f"cd {SHARDS} && stat -c '%n %s %Y %i' * && cat /etc/dflash/manifest-pins/shards.json")
    actual = ct_ok(f"sha256sum {SHARDS}/MANIFEST.json").split()[0]
    wrong = "0123456789abcdef" * 4
    try:
        proc = play(f"shard_sync_manifest_sha256={wrong}", tags="shard_sync")
        assert proc.returncode != 0
        said = " ".join(proc.stdout.split())
        assert (
            f"dflash-s3-sync: error: s3://dflash-lab/shards/MANIFEST.json: sha256 {actual} is not the pinned "
            f"{wrong}; refusing it and leaving the local copy as it is"
        ) in said, proc.stdout[-2000:]
        after = ct_ok(f"cd {SHARDS} && stat -c '%n %s %Y %i' * && cat /etc/dflash/manifest-pins/shards.json")
        assert after == before
    finally:
        restored = play(tags="shard_sync")
        assert restored.returncode == 0, restored.stdout[-2000:]
