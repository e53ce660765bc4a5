"""Shard sync against moto's S3 with the real awscli in the container: first sync, no-op second sync,
truncated and corrupt shards fetched again, an interrupted sync resumed, wrong manifests refused clearly."""

from __future__ import annotations

import json
import re

from tests.l4_data import s3data
from tests.l4_data.conftest import SYNC, ct, ct_ok, sync

NAMES = sorted(s3data.shard_files())


def stat_all(dest: str) -> str:
    return ct_ok(f"cd {dest} && stat -c '%n %s %Y %i' *.arrow")


def assert_complete(dest: str) -> None:
    sums = ct_ok(f"cd {dest} && sha256sum *.arrow")
    manifest = json.loads(ct_ok(f"cat {dest}/MANIFEST.json"))
    want = {e["path"]: e["sha256"] for e in manifest["files"]}
    got = {name: digest for digest, name in (line.split() for line in sums.splitlines())}
    assert got == want
    assert sorted(want) == NAMES


def test_first_sync_fetches_every_shard_with_a_line_each(work: str) -> None:
    proc = sync(f"{work}/shards")
    assert proc.returncode == 0, proc.stderr
    for name in NAMES:
        assert re.search(rf"fetched {name} \(", proc.stdout), proc.stdout
    assert proc.stdout.rstrip().endswith(f"fetched {len(NAMES)} files")
    assert_complete(f"{work}/shards")


def test_second_sync_downloads_nothing(work: str) -> None:
    assert sync(f"{work}/shards").returncode == 0
    before = stat_all(f"{work}/shards")
    proc = sync(f"{work}/shards")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.rstrip().endswith("fetched 0 files")
    assert "fetched shard" not in proc.stdout
    assert stat_all(f"{work}/shards") == before  # same inodes and mtimes: nothing was written


def test_truncated_shard_is_detected_and_fetched_again(work: str) -> None:
    dest = f"{work}/shards"
    assert sync(dest).returncode == 0
    ct_ok(f"truncate -s 1000 {dest}/{NAMES[0]}")
    proc = sync(dest)
    assert proc.returncode == 0, proc.stderr
    assert f"{NAMES[0]}: size 1000, manifest says" in proc.stdout
    assert proc.stdout.rstrip().endswith("fetched 1 files")
    assert_complete(dest)


def test_corrupt_shard_of_the_same_size_is_fetched_again(work: str) -> None:
    dest = f"{work}/shards"
    assert sync(dest).returncode == 0
    ct_ok(f"printf XXXXXXXX | dd of={dest}/{NAMES[1]} bs=1 seek=4096 conv=notrunc status=none")
    proc = sync(dest)
    assert f"{NAMES[1]}: sha256 differs from the manifest" in proc.stdout
    assert proc.stdout.rstrip().endswith("fetched 1 files")
    assert_complete(dest)


def test_full_check_finds_corruption_that_kept_size_and_mtime(work: str) -> None:
    dest = f"{work}/shards"
    assert sync(dest).returncode == 0
    ct_ok(
        f"f={dest}/{NAMES[0]}; t=$(stat -c %y $f); "
        f"printf Z | dd of=$f bs=1 seek=10 conv=notrunc status=none; "
        f'touch -d "$t" $f'
    )
    assert sync(dest).stdout.rstrip().endswith("fetched 0 files")  # the fast path trusts size and mtime
    proc = sync(dest, "--full")
    assert "sha256 differs" in proc.stdout and proc.stdout.rstrip().endswith("fetched 1 files")
    assert_complete(dest)


def test_interrupted_sync_leftovers_are_resumed(work: str) -> None:
    """What a killed sync leaves: some shards complete, a half-written awscli temporary, no MANIFEST.json."""
    dest = f"{work}/shards"
    assert sync(dest).returncode == 0
    ct_ok(
        f"cd {dest} && head -c 5000 {NAMES[0]} > {NAMES[0]}.3fA9b2C1 && "
        f"rm {NAMES[0]} {NAMES[2]} MANIFEST.json"
    )
    proc = sync(dest)
    assert proc.returncode == 0, proc.stderr
    assert f"removing {NAMES[0]}.3fA9b2C1 (a half-written download)" in proc.stdout
    fetched = sorted(re.findall(r"fetched (shard-\d+\.arrow) \(", proc.stdout))
    assert fetched == sorted([NAMES[0], NAMES[2]])
    assert_complete(dest)


def test_killed_sync_resumes(work: str) -> None:
    """A real interruption: the tool and its awscli are killed (SIGKILL to the group) once a shard landed."""
    dest = f"{work}/shards"
    ct_ok(
        f"setsid {SYNC} --config /etc/dflash/shards.sync.json --dest {dest} > {work}/log 2>&1 & pid=$!; "
        f"for i in $(seq 200); do grep -q 'fetched shard' {work}/log && break; sleep 0.05; done; "
        f"kill -KILL -- -$pid 2>/dev/null; wait $pid; exit 0"
    )
    proc = sync(dest)
    assert proc.returncode == 0, proc.stderr
    again = re.findall(r"fetched (shard-\d+\.arrow) \(", proc.stdout)
    assert len(again) < len(NAMES) or "fetched shard" not in ct_ok(f"cat {work}/log")
    assert_complete(dest)


def test_files_not_in_the_manifest_are_removed(work: str) -> None:
    dest = f"{work}/shards"
    assert sync(dest).returncode == 0
    ct_ok(f"echo stale > {dest}/shard-99999.arrow")
    proc = sync(dest)
    assert "removing shard-99999.arrow (not in the manifest)" in proc.stdout
    assert ct(f"test -e {dest}/shard-99999.arrow").returncode == 1


def test_wrong_checksum_in_the_manifest_is_one_clear_error(work: str) -> None:
    manifest = s3data.manifest_of(s3data.SEED_DIR / "shards")
    manifest["files"][1]["sha256"] = "0" * 64
    for name, data in s3data.shard_files().items():
        s3data.put("wrongsum/", name, data)
    text = json.dumps(manifest).encode()
    s3data.put("wrongsum/", "MANIFEST.json", text)
    proc = sync(f"{work}/wrong", source="s3://dflash-l4-test/wrongsum/", pin=s3data.sha256_of(text))
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert NAMES[1] in lines[0] and "s3://dflash-l4-test/wrongsum/MANIFEST.json is wrong" in lines[0]
    assert ct(f"test -e {work}/wrong/MANIFEST.json").returncode == 1  # never marked complete


def test_malformed_manifest_is_one_clear_error(work: str) -> None:
    text = b'{"files": [{"path": "a", "size": "big"}]}'
    s3data.put("badjson/", "MANIFEST.json", text)
    proc = sync(f"{work}/bad", source="s3://dflash-l4-test/badjson/", pin=s3data.sha256_of(text))
    assert proc.returncode == 1
    assert proc.stderr.strip() == (
        "dflash-s3-sync: error: s3://dflash-l4-test/badjson/MANIFEST.json: "
        "files[0].size 'big' (a) is not a byte count"
    )


def test_missing_manifest_is_one_clear_error(work: str) -> None:
    proc = sync(f"{work}/none", source="s3://dflash-l4-test/no-such-prefix/", pin="0" * 64)
    assert proc.returncode == 1
    assert proc.stderr.strip() == (
        "dflash-s3-sync: error: s3://dflash-l4-test/no-such-prefix/MANIFEST.json: cannot read it: "
        "no such object (is the bucket seeded, the prefix right?)"
    )
    assert ct(f"test -e {work}/none").returncode == 1


def test_a_foreign_directory_is_never_emptied(work: str) -> None:
    ct_ok(f"mkdir -p {work}/foreign && echo keep > {work}/foreign/notes.txt")
    proc = sync(f"{work}/foreign")
    assert proc.returncode == 1 and "not made by dflash-s3-sync" in proc.stderr
    assert ct_ok(f"cat {work}/foreign/notes.txt").strip() == "keep"


def test_a_tampered_manifest_is_refused_and_nothing_local_changes(work: str) -> None:
    """Someone who can write the bucket swaps a shard and rewrites the manifest to match: the manifest still
    checks the data, but its own sha256 is not the pinned one (from the inventory), so it is refused, in one
    line naming the URI and both digests, before anything local is touched."""
    prefix, dest = "pinned/", f"{work}/pinned"
    files = s3data.shard_files()
    for name, data in files.items():
        s3data.put(prefix, name, data)
    good = (s3data.SEED_DIR / "shards" / "MANIFEST.json").read_bytes()
    s3data.put(prefix, "MANIFEST.json", good)
    pin = s3data.sha256_of(good)
    source = f"s3://{s3data.BUCKET}/{prefix}"
    assert sync(dest, source=source, pin=pin).returncode == 0
    before = ct_ok(f"cd {dest} && stat -c '%n %s %Y %i' * .dflash-sync.json && sha256sum *")

    evil = s3data.shard_files(seed=99)[NAMES[0]][: len(files[NAMES[0]])]
    manifest = json.loads(good)
    manifest["files"][0]["sha256"] = s3data.sha256_of(evil)  # consistent with the swapped shard
    tampered = (json.dumps(manifest, indent=1) + "\n").encode()
    s3data.put(prefix, NAMES[0], evil)
    s3data.put(prefix, "MANIFEST.json", tampered)
    for extra in ((), ("--full",), ("--dry-run",)):
        proc = sync(dest, *extra, source=source, pin=pin)
        assert proc.returncode == 1, proc.stdout
        assert proc.stderr.strip() == (
            f"dflash-s3-sync: error: {source}MANIFEST.json: sha256 {s3data.sha256_of(tampered)} is not the "
            f"pinned {pin}; refusing it and leaving the local copy as it is (re-pin the inventory's "
            "manifest_sha256 only if this manifest is yours)"
        )
        assert "fetched" not in proc.stdout and "removing" not in proc.stdout
    assert ct_ok(f"cd {dest} && stat -c '%n %s %Y %i' * .dflash-sync.json && sha256sum *") == before


def test_a_sync_without_a_pin_is_refused(work: str) -> None:
    proc = ct(f"{SYNC} --source s3://{s3data.BUCKET}/shards/ --dest {work}/nopin")
    assert proc.returncode == 1
    assert proc.stderr.strip().startswith(
        "dflash-s3-sync: error: manifest_sha256 None: must be the 64 lowercase"
    )
    assert ct(f"test -e {work}/nopin").returncode == 1
