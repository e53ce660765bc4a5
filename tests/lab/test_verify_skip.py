"""ansible/verify_layer.yml skips a layer's checks only when its play changed nothing AND the same checks
passed when they last ran; everything else runs them (a change, edited checks, a failed last run, a verify
run alone as molecule's, VERIFY=all). Real ansible-playbook runs on localhost with the project's
ansible.cfg (so the layer_changes callback is the one `make provision` loads); the "layer" is one task
whose change is chosen, the "checks" a pytest module that records each run."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from lab.settings import REPO

PLAYBOOK = REPO / ".venv" / "bin" / "ansible-playbook"

CONFTEST = """
def pytest_addoption(parser):
    parser.addoption("--inventory")
"""

CHECKS = """
import os
from pathlib import Path

def test_layer():
    with Path(os.environ["FAKE_RAN"]).open("a") as f:
        f.write("ran\\n")
    assert os.environ.get("FAKE_FAIL") != "1", "the fake layer is broken"
"""


@pytest.fixture
def lab(tmp_path: Path) -> Path:
    (tmp_path / "checks").mkdir()
    (tmp_path / "checks" / "conftest.py").write_text(CONFTEST)
    (tmp_path / "checks" / "backends.py").write_text("")
    (tmp_path / "checks" / "test_fake.py").write_text(CHECKS)
    (tmp_path / "hosts.ini").write_text("localhost ansible_connection=local\n")
    verify = (
        f"- name: Verify the fake layer\n  ansible.builtin.import_playbook: {REPO}/ansible/verify_layer.yml\n"
        f"  vars: {{verify_layer: fake, verify_skip_unchanged: true, verify_dir: {tmp_path}/checks,"
        f" verify_stamp_dir: {tmp_path}/stamps}}\n"
    )
    layer = (
        "- name: The fake layer\n  hosts: localhost\n  connection: local\n  gather_facts: false\n  tasks:\n"
        "    - name: Change or not\n      ansible.builtin.command: 'true'\n"
        "      changed_when: fake_change | bool\n"
    )
    (tmp_path / "site.yml").write_text("---\n" + layer + verify)
    (tmp_path / "verify_only.yml").write_text("---\n" + verify)
    return tmp_path


def provision(
    lab: Path,
    change: bool,
    *extra: str,
    playbook: str = "site.yml",
    fail: bool = False,
    callbacks: str | None = None,
) -> tuple[int, str, int]:
    """rc, output, and how many times the checks have run so far."""
    env = dict(
        os.environ,
        ANSIBLE_CONFIG=str(REPO / "ansible" / "ansible.cfg"),
        FAKE_RAN=str(lab / "ran.log"),
        FAKE_FAIL="1" if fail else "0",
        NO_COLOR="1",
    )
    env.pop("DFLASH_LAYER_CHANGES", None)
    if callbacks is not None:
        env["ANSIBLE_CALLBACKS_ENABLED"] = callbacks
    proc = subprocess.run(
        [
            str(PLAYBOOK),
            "-i",
            str(lab / "hosts.ini"),
            str(lab / playbook),
            "-e",
            f"fake_change={change}",
            *extra,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    ran = (lab / "ran.log").read_text().count("ran") if (lab / "ran.log").exists() else 0
    return proc.returncode, proc.stdout + proc.stderr, ran


def test_checks_skip_only_when_nothing_changed_since_they_passed(lab: Path) -> None:
    rc, out, ran = provision(lab, change=True)
    assert (rc, ran) == (0, 1), out
    stamps = list((lab / "stamps").rglob("fake.sha256"))
    assert len(stamps) == 1, out

    # Unchanged since they passed: skipped and said so, also with another callback list (profiling).
    rc, out, ran = provision(lab, change=False, callbacks="ansible.posix.profile_tasks")
    assert (rc, ran) == (0, 1), out
    assert "ran 1 task(s) and changed nothing" in out and "skipped; `make verify`" in out, out

    # Edited checks run again.
    (lab / "checks" / "test_fake.py").write_text(CHECKS + "\n# edited\n")
    rc, out, ran = provision(lab, change=False)
    assert (rc, ran) == (0, 2), out

    # A failure stops the run and removes the stamp, so the unchanged rerun checks again and fails again.
    rc, out, ran = provision(lab, change=True, fail=True)
    assert rc != 0 and ran == 3, out
    assert "fake failed its checks" in out
    assert not stamps[0].exists()
    rc, out, ran = provision(lab, change=False, fail=True)
    assert rc != 0 and ran == 4, out

    # Molecule's verify step: a run of its own, no layer play before it: the checks run.
    rc, out, ran = provision(lab, change=False, playbook="verify_only.yml")
    assert (rc, ran) == (0, 5), out
    assert stamps[0].exists()

    # `make provision VERIFY=all`.
    rc, out, ran = provision(lab, False, "-e", "verify_skip_unchanged=false")
    assert (rc, ran) == (0, 6), out
