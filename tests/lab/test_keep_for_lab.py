"""The lab keeps, under lab_dir, the archive each CT was made from, and a record pointing at it: the L2 role
uploads that file and checks its size against the record. Two builds of one commit have the same name and
different bytes (docs/image.md#output-name-and-volid), so each CT's record names the file of the build it was
made from: a rebuild leaves the role's size check of an older CT passing."""

from __future__ import annotations

import concurrent.futures
import hashlib
import shutil
import threading
from pathlib import Path

from lab import image


def build(out: Path, content: bytes) -> image.BuiltImage:
    """A finished build as image/build.sh records it; every build of one commit has the same name."""
    out.mkdir(parents=True)
    archive = out / "debian-12-dflash-cpu_0.1.0-g1234567_amd64.tar.zst"
    archive.write_bytes(content)
    return image.BuiltImage(
        {
            "path": str(archive),
            "name": archive.name,
            "volid": f"local:vztmpl/{archive.name}",
            "sha256": hashlib.sha256(content).hexdigest(),
            "size_bytes": len(content),
            "manifest": {"variant": "cpu"},
        }
    )


def assert_record_matches_its_file(record_path: Path, content: bytes) -> None:
    kept = image.read_record(record_path)
    assert kept is not None, f"{record_path} names no archive"
    assert kept.path.read_bytes() == content, f"{record_path} points at another build's archive"
    assert kept.path.stat().st_size == kept.record["size_bytes"]
    assert kept.path.name == kept.name, "the kept file must keep the name the role uploads it under"


def test_a_rebuild_of_one_commit_is_kept_beside_the_first(tmp_path: Path) -> None:
    lab_images = tmp_path / "lab" / "images"
    first = build(tmp_path / "a", b"first build")
    image.keep_for_lab(first, lab_images / "lab-ct200.json")
    second = build(tmp_path / "b", b"second build, same commit")
    image.keep_for_lab(second, lab_images / "lab-ct201.json")
    assert_record_matches_its_file(lab_images / "lab-ct201.json", b"second build, same commit")
    assert_record_matches_its_file(lab_images / "lab-ct200.json", b"first build")


def test_one_build_is_kept_once(tmp_path: Path) -> None:
    lab_images = tmp_path / "lab" / "images"
    built = build(tmp_path / "a", b"one build")
    one = image.keep_for_lab(built, lab_images / "lab-ct201.json")
    other = image.keep_for_lab(built, lab_images / "lab-ct202.json")
    assert one.path == other.path
    assert one.path.samefile(built.path), "the archive is linked, not copied, on one file system"


def test_the_containers_of_a_multinode_lab_keep_one_build_side_by_side(tmp_path: Path) -> None:
    """`make lab` makes its CTs in threads (lab/cli.py), each keeping the same archive: one thread at a time
    keeps it, so none renames the partial file away under another (FileNotFoundError)."""
    lab_images = tmp_path / "lab" / "images"
    built = build(tmp_path / "a", b"one build" * 4096)
    start = threading.Barrier(8)

    def keep(n: int) -> image.BuiltImage:
        start.wait()
        return image.keep_for_lab(built, lab_images / f"lab-ct{200 + n}.json")

    for _ in range(20):  # a race between the threads shows only in some rounds
        shutil.rmtree(lab_images, ignore_errors=True)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            kept = list(pool.map(keep, range(8)))
        assert {k.path for k in kept} == {kept[0].path}
        for n in range(8):
            assert_record_matches_its_file(lab_images / f"lab-ct{200 + n}.json", b"one build" * 4096)
        leftovers = [p.name for p in lab_images.rglob(".*")]
        assert not leftovers, f"partial files left behind: {leftovers}"
