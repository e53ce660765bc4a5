#!/usr/bin/env python3
"""Checks that the Ansible collections this project resolves satisfy ansible/requirements.yml.

Usage: check_collections.py REQUIREMENTS_YML   (the tools venv's Python; ANSIBLE_CONFIG names ansible.cfg)

A check, not an install (bootstrap cannot reach Galaxy): the installed version of each collection is the one
`ansible-galaxy collection list` finds first on the configured collections path, the one Ansible loads. It
must meet the requirement's version (Galaxy's syntax: "1.2.3", "==1.2.3", ">=1.2,<2", "*"), compared by
ansible-core's own meets_requirements. One line per collection missing or at another version; exit 1 then.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml
from ansible.galaxy.dependency_resolution.versioning import meets_requirements


def required(path: Path) -> dict[str, str]:
    data = yaml.safe_load(path.read_text()) or {}
    out = {}
    for item in data.get("collections") or []:
        name, version = (
            (item, "*") if isinstance(item, str) else (item["name"], str(item.get("version", "*")))
        )
        out[name] = version
    return out


def installed() -> dict[str, tuple[str, str]]:
    """FQCN: (version, path) of the first of each on the collections path, in Ansible's search order."""
    galaxy = Path(sys.executable).parent / "ansible-galaxy"
    proc = subprocess.run(
        [str(galaxy), "collection", "list", "--format", "json"], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise SystemExit(f"check_collections: {galaxy} collection list failed: {proc.stderr.strip()}")
    found: dict[str, tuple[str, str]] = {}
    for path, collections in json.loads(proc.stdout).items():
        for name, info in collections.items():
            found.setdefault(name, (str(info.get("version", "*")), path))
    return found


def problems(requirements: dict[str, str], have: dict[str, tuple[str, str]], source: str) -> list[str]:
    out = []
    for name, want in requirements.items():
        if name not in have:
            out.append(
                f"{name}: required {want} by {source}, not installed (the tools venv's ansible package)"
            )
        elif not meets_requirements(have[name][0], want):
            out.append(f"{name}: required {want} by {source}, installed {have[name][0]} in {have[name][1]}")
    return out


def main() -> int:
    if len(sys.argv) != 2:
        print("usage: check_collections.py REQUIREMENTS_YML", file=sys.stderr)
        return 2
    path = Path(sys.argv[1])
    found = problems(required(path), installed(), str(path))
    for line in found:
        print(f"check_collections: {line}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
