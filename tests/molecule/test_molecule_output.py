"""What `make test` prints around the molecule scenarios: no red CRITICAL line before a scenario that then
passes, and no ANSI colour codes in output that goes to a file. Syntax-only runs: the lab is never touched."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from lab.settings import REPO

VENV_BIN = Path(REPO / ".venv" / "bin")


def run(*argv: str, **env: str) -> subprocess.CompletedProcess[str]:
    """ARGV with stdout and stderr into a pipe (as `make test > log` does), under a terminal's TERM."""
    base = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "ANSIBLE_NOCOLOR", "PY_COLORS")}
    base |= {
        "TERM": "xterm-256color",
        "PATH": f"{VENV_BIN}:{os.environ['PATH']}",
        "ANSIBLE_CONFIG": str(REPO / "ansible" / "ansible.cfg"),
    }
    return subprocess.run(
        list(argv),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=base | env,
    )


def test_a_scenario_run_logs_no_critical_glob_failure() -> None:
    """molecule looks for molecule/default on every run and logs CRITICAL when it is missing."""
    proc = run(str(VENV_BIN / "molecule"), "syntax", "-s", "l2-container")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "glob failed" not in out and "CRITICAL" not in out, out[-3000:]


def test_molecule_all_writes_no_colour_codes_into_a_log() -> None:
    proc = run(str(REPO / "scripts" / "molecule_all.sh"), "default")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "molecule: 1 scenario(s) passed" in proc.stdout
    assert "\x1b[" not in out, f"ANSI escape codes in piped output: {out[:1500]!r}"


def test_molecule_all_names_an_unknown_scenario() -> None:
    proc = run(str(REPO / "scripts" / "molecule_all.sh"), "no-such-scenario")
    assert proc.returncode == 1
    assert "no such scenario among: no-such-scenario" in proc.stderr
