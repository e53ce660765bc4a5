#!/usr/bin/env python3
"""Builds the trainer wheel reproducibly and writes the one-line hash lock every install is checked against.

Usage: pack_trainer.py TRAINER_DIR DEST_DIR   (run by the Python whose setuptools builds it: the tools venv)

Writes into DEST_DIR:
  dflash_trainer-VERSION-py3-none-any.whl  the wheel; rewritten (through .partial and a rename) only when
                                           its bytes differ, and then "changed" on stderr
  trainer-wheel.lock                       `dflash-trainer==VERSION --hash=sha256:...`, the lock L3 and the
                                           image install with --no-index --no-deps --require-hashes
  trainer-wheel.json                       the record: the wheel's name, its sha256, the digest of its inputs
Prints {"wheel": NAME, "sha256": HEX} on stdout.

Why the build writes the lock and git does not hold it: the wheel's sha256 moves with every source change, so
a committed one would be stale after each edit. The build is reproducible instead (same sources, setuptools
and script: same bytes) and records which inputs gave which sha256: a later build of the same inputs that
gives other bytes is refused, the recorded wheel is reused only while its bytes still have that sha256, and
every install takes only the file of that sha256.

No network and no build isolation: `pip wheel --no-build-isolation --no-index` with the setuptools already in
this Python (requirements/tools.lock pins it with its sha256), so no unchecked setuptools is fetched.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from importlib import metadata
from pathlib import Path

SKIP = ("__pycache__", ".egg-info", ".pyc")
# Zip timestamps of every member (bdist_wheel reads it); ZIP cannot store a time before 1980.
EPOCH = "315532800"
LOCK = "trainer-wheel.lock"
RECORD = "trainer-wheel.json"
PIP_WHEEL = ["-m", "pip", "wheel", "--isolated", "--no-build-isolation", "--no-index", "--no-deps",
             "--disable-pip-version-check", "--quiet", "--wheel-dir"]  # fmt: skip


class PackError(Exception):
    """One line naming the cause."""


def inputs(trainer: Path) -> list[Path]:
    sources = (p for p in (trainer / "src").rglob("*") if p.is_file() and not any(s in str(p) for s in SKIP))
    return [trainer / "pyproject.toml", *sorted(sources)]


def backend() -> str:
    try:
        return f"setuptools {metadata.version('setuptools')}"
    except metadata.PackageNotFoundError:
        raise PackError(
            f"no setuptools in {sys.executable}: requirements/tools.lock pins it (make bootstrap)"
        ) from None


def inputs_digest(trainer: Path, files: list[Path], builder: str) -> str:
    # This script's bytes too: they decide the build's settings (EPOCH, modes).
    digest = hashlib.sha256(builder.encode() + b"\0" + Path(__file__).read_bytes() + b"\0")
    for path in files:
        digest.update(str(path.relative_to(trainer)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def build(trainer: Path, files: list[Path], work: Path) -> Path:
    """The wheel from a copy of the inputs at fixed modes, so the build writes nothing into the tree and the
    checkout's umask and file modes do not reach the zip."""
    src = work / "src"
    for path in files:
        copy = src / path.relative_to(trainer)
        copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, copy)
        copy.chmod(0o644)
    for d in (p for p in src.rglob("*") if p.is_dir()):
        d.chmod(0o755)
    env = {**os.environ, "SOURCE_DATE_EPOCH": EPOCH, "PIP_NO_CACHE_DIR": "1"}
    old_umask = os.umask(0o022)
    try:
        proc = subprocess.run([sys.executable, *PIP_WHEEL, str(work / "dist"), str(src)], env=env,
                              capture_output=True, text=True, check=False)  # fmt: skip
    finally:
        os.umask(old_umask)
    wheels = sorted((work / "dist").glob("dflash_trainer-*.whl"))
    if proc.returncode != 0 or len(wheels) != 1:
        why = (proc.stderr.strip().splitlines() or ["no wheel written"])[-1]
        raise PackError(f"pip wheel --no-build-isolation of {trainer} failed: {why}")
    return wheels[0]


def _sha256(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def lock_text(version: str, sha: str) -> bytes:
    head = "# Written by pack_trainer.py, beside its wheel (pip install --no-index --require-hashes).\n"
    return f"{head}dflash-trainer=={version} \\\n    --hash=sha256:{sha}\n".encode()


def write_if_changed(dest: Path, blob: bytes) -> bool:
    if dest.exists() and dest.read_bytes() == blob:
        return False
    partial = dest.with_name(dest.name + ".partial")
    partial.write_bytes(blob)
    partial.rename(dest)
    return True


def pack(trainer: Path, dest: Path) -> dict[str, str]:
    if not (trainer / "pyproject.toml").is_file():
        raise PackError(f"{trainer}/pyproject.toml: no such file")
    version = tomllib.loads((trainer / "pyproject.toml").read_text())["project"]["version"]
    files = inputs(trainer)
    digest = inputs_digest(trainer, files, backend())
    record_path = dest / RECORD
    old = json.loads(record_path.read_text()) if record_path.is_file() else {}
    if old.get("inputs_sha256") == digest and _sha256(dest / str(old.get("wheel"))) == old.get("sha256"):
        write_if_changed(dest / LOCK, lock_text(version, old["sha256"]))
        return {"wheel": old["wheel"], "sha256": old["sha256"]}  # these inputs' wheel, unchanged on disk
    with tempfile.TemporaryDirectory(prefix="pack-trainer-") as tmp:
        wheel = build(trainer, files, Path(tmp))
        name, blob = wheel.name, wheel.read_bytes()
    sha = hashlib.sha256(blob).hexdigest()
    if old.get("inputs_sha256") == digest and old.get("sha256") != sha:
        raise PackError(
            f"the trainer wheel is not reproducible: the inputs recorded in {record_path} gave sha256 "
            f"{old.get('sha256')}, this build {sha}"
        )
    dest.mkdir(parents=True, exist_ok=True)
    for stale in dest.glob("dflash_trainer-*.whl"):
        if stale.name != name:
            stale.unlink()
    changed = write_if_changed(dest / name, blob)
    write_if_changed(dest / LOCK, lock_text(version, sha))
    record = {"wheel": name, "version": version, "sha256": sha, "inputs_sha256": digest}
    write_if_changed(record_path, (json.dumps(record, indent=2) + "\n").encode())
    if changed:
        print("changed", file=sys.stderr)
    return {"wheel": name, "sha256": sha}


def main() -> int:
    if len(sys.argv) != 3:
        print("usage: pack_trainer.py TRAINER_DIR DEST_DIR", file=sys.stderr)
        return 2
    try:
        print(json.dumps(pack(Path(sys.argv[1]), Path(sys.argv[2]))))
    except PackError as err:
        print(f"pack_trainer: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
