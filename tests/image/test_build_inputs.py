"""image/build.sh on bad input: it stops with the cause and leaves no archive, no .partial and no temporary
directory behind. Each run uses its own output and cache directories, so a real build is never disturbed."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from lab.settings import REPO

BUILD = REPO / "image" / "build.sh"
WARM_APT = Path("/var/cache/dflash-image/apt")


def build(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    out = tmp_path / "out"
    base = {"IMAGE_OUT_DIR": str(out), "IMAGE_CACHE": str(tmp_path / "cache")}
    return subprocess.run(
        [str(BUILD), *args],
        text=True,
        capture_output=True,
        timeout=1200,
        check=False,
        env={**os.environ, **base, **env},
    )


def assert_nothing_left(tmp_path: Path) -> None:
    out = tmp_path / "out"
    left = sorted(p.name for p in out.iterdir() if not p.name.endswith(".log")) if out.exists() else []
    assert left == [], f"left behind in {out}: {left}"


def test_no_room_on_disk_stops_before_writing(tmp_path: Path) -> None:
    proc = build(tmp_path, "cpu", IMAGE_MIN_FREE_GB="1000000")
    assert proc.returncode != 0
    assert "not enough free space for a cpu build" in proc.stderr
    assert "1000000 GiB needed" in proc.stderr
    assert_nothing_left(tmp_path)


def test_unknown_variant_is_refused(tmp_path: Path) -> None:
    proc = build(tmp_path, "rocm")
    assert proc.returncode != 0
    assert "rocm" in proc.stderr


def test_print_names_predictable_archive_and_volid(tmp_path: Path) -> None:
    proc = build(tmp_path, "--print", "cuda", IMAGE_STORAGE="local")
    assert proc.returncode == 0, proc.stderr
    info = dict(line.split("=", 1) for line in proc.stdout.splitlines())
    assert info["name"].startswith("debian-12-dflash-cuda_") and info["name"].endswith("_amd64.tar.zst")
    assert info["volid"] == f"local:vztmpl/{info['name']}"
    assert info["path"] == str(tmp_path / "out" / info["name"])


ANY_HASH = "--hash=sha256:" + "0" * 64
# mdurl 0.1.2's one wheel on PyPI (and in the local mirror): a small real file to check hashes against.
MDURL = "mdurl==0.1.2"
MDURL_SHA256 = "84008a41e51615a49fc9966191ff91509e3c40b939176e643fd50a5c2196b8f8"


def test_lock_that_does_not_resolve(tmp_path: Path) -> None:
    lock = tmp_path / "requirements.lock"
    lock.write_text(f"safetensors==0.0.0.dev424242 {ANY_HASH}\n")
    proc = build(tmp_path, "cpu", IMAGE_LOCK=str(lock))
    assert proc.returncode != 0
    assert "wheels" in proc.stderr and "FAILED" in proc.stderr
    assert "the lock does not resolve for cpu" in proc.stderr
    assert "safetensors==0.0.0.dev424242" in proc.stderr
    assert_nothing_left(tmp_path)


def test_a_file_that_matches_no_hash_of_the_lock_is_refused(tmp_path: Path) -> None:
    lock = tmp_path / "requirements.lock"
    lock.write_text(f"{MDURL} {ANY_HASH}\n")
    proc = build(tmp_path, "cpu", IMAGE_LOCK=str(lock))
    assert proc.returncode != 0
    assert "wheels" in proc.stderr and "FAILED" in proc.stderr
    assert "a downloaded file matches none of its hashes in requirements.lock" in proc.stderr, proc.stderr
    assert f"{MDURL} (expected {'0' * 64}, got {MDURL_SHA256})" in proc.stderr, proc.stderr
    assert not list((tmp_path / "cache" / "wheels" / "cpu").glob("mdurl-*")), "the refused file was kept"
    assert_nothing_left(tmp_path)


def test_a_tampered_file_in_the_wheelhouse_is_replaced(tmp_path: Path) -> None:
    """The warm wheelhouse is checked against the lock too: a file there that matches none of its hashes is
    removed and fetched again. The build is stopped right after the wheels (an unreachable Debian mirror)."""
    lock = tmp_path / "requirements.lock"
    lock.write_text(f"{MDURL} --hash=sha256:{MDURL_SHA256}\n")
    wheelhouse = tmp_path / "cache" / "wheels" / "cuda"  # cuda: the cpu variant also insists on a CPU torch
    wheelhouse.mkdir(parents=True)
    (wheelhouse / "mdurl-0.1.2-py3-none-any.whl").write_bytes(b"not the wheel the lock names")
    proc = build(
        tmp_path,
        "cuda",
        IMAGE_LOCK=str(lock),
        IMAGE_MIRROR="http://127.0.0.1:9/debian",
        IMAGE_MIN_FREE_GB="1",
    )
    log = (tmp_path / "out" / "cuda.log").read_text()
    assert "mdurl-0.1.2-py3-none-any.whl in the wheelhouse matched none of its hashes" in log, log[-3000:]
    wheel = (wheelhouse / "mdurl-0.1.2-py3-none-any.whl").read_bytes()
    assert hashlib.sha256(wheel).hexdigest() == MDURL_SHA256
    assert proc.returncode != 0 and "rootfs" in proc.stderr, proc.stderr  # stopped where it was told to
    assert_nothing_left(tmp_path)


def test_prune_keeps_the_newest_archives_and_the_latest_build(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    archives = [out / f"debian-12-dflash-cpu_0.1.0-g{n:07d}_amd64.tar.zst" for n in range(4)]
    for age, archive in enumerate(reversed(archives)):  # archives[0] oldest
        archive.write_bytes(b"x")
        archive.with_name(archive.name.removesuffix(".tar.zst") + ".json").write_text("{}")
        os.utime(archive, (1_000_000 - age * 1000, 1_000_000 - age * 1000))
    other = out / "debian-12-dflash-cuda_0.1.0-g0000000_amd64.tar.zst"
    other.write_bytes(b"x")
    (out / "cpu.json").write_text(json.dumps({"path": str(archives[0])}))  # the latest build, though oldest
    proc = build(tmp_path, "--prune", "cpu", IMAGE_KEEP="2")
    assert proc.returncode == 0, proc.stderr
    left = sorted(p.name for p in out.glob("*.tar.zst"))
    assert left == sorted([archives[0].name, archives[2].name, archives[3].name, other.name])
    assert not archives[1].with_name(archives[1].name.removesuffix(".tar.zst") + ".json").exists()
    assert f"pruned    {archives[1].name}" in proc.stdout


def test_prune_of_an_empty_directory_does_nothing(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    proc = build(tmp_path, "--prune", "cuda")
    assert proc.returncode == 0 and proc.stdout == "", proc.stderr


def test_prune_refuses_a_bad_keep(tmp_path: Path) -> None:
    proc = build(tmp_path, "--prune", "cpu", IMAGE_KEEP="0")
    assert proc.returncode != 0 and "IMAGE_KEEP must be a whole number of 1 or more" in proc.stderr


@pytest.mark.slow
def test_missing_debian_package(tmp_path: Path) -> None:
    packages = tmp_path / "packages.in"
    packages.write_text((REPO / "image" / "packages.in").read_text() + "dflash-no-such-package\n")
    cache = tmp_path / "cache"
    if (WARM_APT / "archives").is_dir():  # a copy of the warm apt cache: seconds instead of minutes
        shutil.copytree(WARM_APT, cache / "apt")
    proc = build(
        tmp_path, "cpu", IMAGE_PACKAGES_IN=str(packages), IMAGE_CACHE=str(cache), IMAGE_ZSTD_LEVEL="1"
    )
    assert proc.returncode != 0
    assert "rootfs" in proc.stderr and "FAILED" in proc.stderr
    assert "Unable to locate package dflash-no-such-package" in proc.stderr
    assert_nothing_left(tmp_path)
