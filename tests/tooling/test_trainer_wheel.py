"""The trainer wheel (roles/ct_environment/files/pack_trainer.py, used by L3 and image/build.sh): built
offline without build isolation, the same bytes from the same sources whatever the checkout's file modes and
umask, and a hash lock beside it that pip installs by with --no-index --no-deps --require-hashes."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

from lab.settings import REPO

PACK = REPO / "roles/ct_environment/files/pack_trainer.py"


def checkout(tmp: Path, name: str) -> Path:
    """A copy of trainer/'s inputs, as another clone would have them."""
    copy = tmp / name
    copy.mkdir()
    shutil.copy(REPO / "trainer/pyproject.toml", copy)
    shutil.copytree(
        REPO / "trainer/src", copy / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info")
    )
    return copy


def pack(trainer: Path, dest: Path, umask: str = "022") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["sh", "-c", f'umask {umask}; exec "$0" "$@"', sys.executable, str(PACK), str(trainer), str(dest)],
        capture_output=True, text=True, check=False, timeout=600,
    )  # fmt: skip


def test_same_sources_same_wheel_and_its_lock(tmp_path: Path) -> None:
    one, two = checkout(tmp_path, "one"), checkout(tmp_path, "two")
    (two / "src/dflash_trainer/cli.py").chmod(0o600)  # another clone's modes and umask reach nothing
    first, second = pack(one, tmp_path / "a"), pack(two, tmp_path / "b", umask="077")
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    a, b = json.loads(first.stdout), json.loads(second.stdout)
    assert a == b, f"two builds of the same sources differ: {a} against {b}"
    wheel = (tmp_path / "a" / a["wheel"]).read_bytes()
    assert hashlib.sha256(wheel).hexdigest() == a["sha256"]
    lock = (tmp_path / "a/trainer-wheel.lock").read_text()
    assert f"dflash-trainer==0.1.0 \\\n    --hash=sha256:{a['sha256']}\n" in lock


def test_a_source_change_is_a_new_wheel_and_a_new_lock(tmp_path: Path) -> None:
    trainer = checkout(tmp_path, "t")
    before = json.loads(pack(trainer, tmp_path / "out").stdout)
    with (trainer / "src/dflash_trainer/__init__.py").open("a") as f:
        f.write("# edited\n")
    proc = pack(trainer, tmp_path / "out")
    after = json.loads(proc.stdout)
    assert after["sha256"] != before["sha256"] and "changed" in proc.stderr
    assert after["sha256"] in (tmp_path / "out/trainer-wheel.lock").read_text()


def test_a_build_that_differs_from_the_record_of_the_same_inputs_is_refused(tmp_path: Path) -> None:
    trainer = checkout(tmp_path, "t")
    assert pack(trainer, tmp_path / "out").returncode == 0
    record = tmp_path / "out/trainer-wheel.json"
    fake = json.loads(record.read_text()) | {"sha256": "0" * 64}  # what another machine recorded
    record.write_text(json.dumps(fake))
    proc = pack(trainer, tmp_path / "out")
    assert proc.returncode == 1
    assert proc.stderr.startswith("pack_trainer: the trainer wheel is not reproducible"), proc.stderr
    assert proc.stderr.count("\n") == 1


def test_a_tampered_wheel_is_built_again_and_pip_refuses_a_wrong_hash(tmp_path: Path) -> None:
    trainer = checkout(tmp_path, "t")
    good = json.loads(pack(trainer, tmp_path / "out").stdout)
    wheel = tmp_path / "out" / good["wheel"]
    wheel.write_bytes(wheel.read_bytes() + b"tampered")
    proc = pack(trainer, tmp_path / "out")
    assert json.loads(proc.stdout) == good and "changed" in proc.stderr
    assert hashlib.sha256(wheel.read_bytes()).hexdigest() == good["sha256"]
    wheel.write_bytes(wheel.read_bytes() + b"tampered")  # after the build: the install refuses it
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    out = tmp_path / "out"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(venv / "bin/python"), "install", "--no-index",
         "--no-deps", "--require-hashes", "--find-links", str(out), "-r", str(out / "trainer-wheel.lock")],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert install.returncode != 0 and "DO NOT MATCH THE HASHES" in install.stderr, install.stderr
