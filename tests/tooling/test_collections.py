"""ansible/requirements.yml declares every collection the roles, playbooks and inventories name, and
scripts/check_collections.py (run by bootstrap) refuses an installed set that does not satisfy it, one line
naming the collection. It checks what Ansible loads: the tools venv's ansible package (ansible.cfg)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

from lab.settings import REPO

CHECK = REPO / "scripts/check_collections.py"
REQUIREMENTS = REPO / "ansible/requirements.yml"
# A module, plugin or filter by its FQCN, namespace.collection.name (ansible.builtin comes with the core).
FQCN = re.compile(r"\b(ansible\.posix|community\.[a-z_]+|containers\.[a-z_]+)\.[a-z_]+\b")


def check(requirements: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "ANSIBLE_CONFIG": str(REPO / "ansible/ansible.cfg")}
    return subprocess.run(
        [sys.executable, str(CHECK), str(requirements)], capture_output=True, text=True, env=env, check=False
    )


def declared() -> dict[str, str]:
    return {c["name"]: c["version"] for c in yaml.safe_load(REQUIREMENTS.read_text())["collections"]}


def test_every_collection_the_project_names_is_declared() -> None:
    used = set()
    for folder in ("roles", "ansible", "inventory"):
        for path in (REPO / folder).rglob("*"):
            if path.is_file() and path.suffix in (".yml", ".yaml", ".j2", ".cfg"):
                used |= {m.group(1) for m in FQCN.finditer(path.read_text(errors="replace"))}
    assert used, "no collection found: the pattern is wrong"
    assert used <= set(declared()), f"named but not in {REQUIREMENTS}: {sorted(used - set(declared()))}"


def test_the_installed_collections_satisfy_requirements_yml() -> None:
    proc = check(REQUIREMENTS)
    assert proc.returncode == 0, proc.stderr


def test_another_version_is_one_line_naming_the_collection(tmp_path: Path) -> None:
    wrong = tmp_path / "requirements.yml"
    pins = declared() | {"community.general": ">=99.0.0"}
    wrong.write_text(yaml.safe_dump({"collections": [{"name": n, "version": v} for n, v in pins.items()]}))
    proc = check(wrong)
    assert proc.returncode == 1
    [line] = proc.stderr.splitlines()
    assert line.startswith("check_collections: community.general: required >=99.0.0 by "), line
    assert f"installed {declared()['community.general']} in " in line


def test_a_missing_collection_is_named(tmp_path: Path) -> None:
    wrong = tmp_path / "requirements.yml"
    wrong.write_text("collections:\n  - name: community.nosuchthing\n    version: '1.0.0'\n")
    proc = check(wrong)
    assert proc.returncode == 1
    assert proc.stderr.startswith("check_collections: community.nosuchthing: required 1.0.0 by "), proc.stderr
    assert "not installed" in proc.stderr and proc.stderr.count("\n") == 1
