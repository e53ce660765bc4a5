"""Two builds of one commit give the same image: the same Debian set and venv (the manifest, which records
both in full) and the same files at the same sizes and modes. Not bit for bit: byte-compiled files and a few
timestamps inside maintainer scripts differ (docs/image.md). Slow: two cpu builds with warm caches."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from lab.settings import REPO

pytestmark = pytest.mark.slow

# Written at build time by design, or by Python when it byte-compiles.
VOLATILE_SUFFIXES = (".pyc",)


def build(out: Path) -> dict:
    proc = subprocess.run(
        [str(REPO / "image" / "build.sh"), "cpu"],
        env={**os.environ, "IMAGE_OUT_DIR": str(out)},
        capture_output=True,
        text=True,
        timeout=3600,
        check=False,
    )
    assert proc.returncode == 0, f"image/build.sh cpu failed:\n{proc.stdout}{proc.stderr}"
    return json.loads((out / "cpu.json").read_text())


def members(archive: Path) -> set[tuple[str, str, str]]:
    """(mode, size, name) of every entry of the archive; symlinks keep their target in the name."""
    listing = subprocess.run(
        f"zstd -dc '{archive}' | tar -tvf - --numeric-owner",
        shell=True,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    entries = set()
    for line in listing.splitlines():
        mode, _owner, size, _date, _time, name = line.split(maxsplit=5)
        if not name.endswith(VOLATILE_SUFFIXES):
            entries.add((mode, size, name))
    return entries


def test_two_builds_of_one_commit_give_the_same_image(tmp_path: Path) -> None:
    first, second = build(tmp_path / "a"), build(tmp_path / "b")
    assert first["name"] == second["name"]
    assert first["manifest"] == second["manifest"], "the package set or the environment differs"
    only_first = members(Path(first["path"])) - members(Path(second["path"]))
    only_second = members(Path(second["path"])) - members(Path(first["path"]))
    assert not only_first and not only_second, (
        f"files differ: {sorted(only_first)[:10]} against {sorted(only_second)[:10]}"
    )
