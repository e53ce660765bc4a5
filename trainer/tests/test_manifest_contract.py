"""The manifest format has one module (dflash_trainer.manifest) and three users: the trainer,
dflash-stage-model (roles/model_stage) and dflash-s3-sync (roles/shard_sync). The tools run on a bare python3
with a copy of the module installed beside them: each copy is the module byte for byte, the same manifest
bytes parse to the same entries everywhere, a manifest the trainer writes stages with every sha256 checked,
and a malformed one fails with the same line naming the file (and the JSON line) in all three."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_trainer import manifest
from dflash_trainer.manifest import ManifestError, read_manifest, verify_manifest, write_manifest

REPO = Path(__file__).resolve().parents[2]
STAGE = REPO / "roles/model_stage/files/dflash_stage_model.py"
SYNC = REPO / "roles/shard_sync/files/dflash_s3_sync.py"
COPIES = [
    REPO / "roles/model_stage/files/dflash_manifest.py",
    REPO / "roles/shard_sync/files/dflash_manifest.py",
]
DIGEST = "ab" * 32


@pytest.mark.parametrize("copy", COPIES, ids=lambda p: p.parent.parent.name)
def test_each_tools_copy_is_the_module_byte_for_byte(copy: Path) -> None:
    assert copy.read_bytes() == Path(manifest.__file__).read_bytes(), (
        f"{copy} differs from {manifest.__file__}: copy the module over it"
    )


def test_the_module_imports_the_standard_library_only() -> None:
    """What the tools' bare python3 has: run with -I (no site-packages, no PYTHONPATH) beside a copy."""
    code = "import sys; sys.path.insert(0, sys.argv[1]); import dflash_manifest"
    proc = subprocess.run(
        [sys.executable, "-I", "-S", "-c", code, str(COPIES[0].parent)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr


def tool_parse(tool: Path, raw: bytes, where: str) -> dict:
    """The tool's own module (imported as the installed tool imports it) parsing `raw`: entries or error."""
    code = (
        "import json, sys\n"
        "sys.path.insert(0, sys.argv[1])\n"
        f"import {tool.stem} as tool\n"
        "raw = sys.stdin.buffer.read()\n"
        "try:\n"
        "    print(json.dumps({'entries': tool.manifest.parse_manifest(raw, sys.argv[2])}))\n"
        "except tool.manifest.ManifestError as e:\n"
        "    print(json.dumps({'error': str(e)}))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-I", "-c", code, str(tool.parent), where],
        input=raw,
        capture_output=True,
        check=True,
    )
    return json.loads(proc.stdout)


def trainer_parse(raw: bytes, where: str) -> dict:
    try:
        return {"entries": manifest.parse_manifest(raw, where)}
    except ManifestError as e:
        return {"error": str(e)}


def entry(path: str = "a", size: int = 1, sha256: str = DIGEST) -> dict:
    return {"path": path, "size": size, "sha256": sha256}


MANIFESTS = {
    "valid": json.dumps({"version": 1, "files": [entry("b/c"), entry("a", 0)]}).encode(),
    "not-json": b'{"version": 1,\n "files": [\n  {"path": "a",}\n ]}\n',
    "not-utf8": b'{"files": ["\xff"]}',
    "no-files": b'{"version": 1}',
    "version-2": json.dumps({"version": 2, "files": [entry()]}).encode(),
    "escapes": json.dumps({"files": [entry("../x")]}).encode(),
    "absolute": json.dumps({"files": [entry("/etc/passwd")]}).encode(),
    "lists-itself": json.dumps({"files": [entry("MANIFEST.json")]}).encode(),
    "sync-state": json.dumps({"files": [entry("d/.dflash-sync.json")]}).encode(),
    "size-bool": json.dumps({"files": [entry(size=True)]}).encode(),
    "size-negative": json.dumps({"files": [entry(size=-1)]}).encode(),
    "sha-upper": json.dumps({"files": [entry(sha256=DIGEST.upper())]}).encode(),
    "twice": json.dumps({"files": [entry(), entry()]}).encode(),
    "empty": json.dumps({"files": []}).encode(),
    "entry-not-object": json.dumps({"files": ["a"]}).encode(),
}


@pytest.mark.parametrize("raw", MANIFESTS.values(), ids=MANIFESTS.keys())
def test_the_same_bytes_parse_the_same_way_in_all_three(raw: bytes) -> None:
    where = "/srv/model/MANIFEST.json"
    mine = trainer_parse(raw, where)
    assert tool_parse(STAGE, raw, where) == mine
    assert tool_parse(SYNC, raw, where) == mine
    if "error" in mine:
        assert mine["error"].startswith(f"{where}: ")


def test_a_json_error_names_the_line() -> None:
    assert trainer_parse(MANIFESTS["not-json"], "M")["error"].startswith("M: not JSON (")
    assert "line 3 column" in trainer_parse(MANIFESTS["not-json"], "M")["error"]


def model(tmp_path: Path) -> Path:
    src = tmp_path / "store"
    (src / "sub").mkdir(parents=True)
    (src / "config.json").write_text('{"hidden_size": 8}')
    (src / "sub" / "weights.bin").write_bytes(bytes(range(256)) * 4099)
    (src / "empty").write_bytes(b"")
    write_manifest(src)
    return src


def test_a_manifest_the_trainer_writes_stages_with_every_digest_checked(tmp_path: Path) -> None:
    src = model(tmp_path)
    dest = tmp_path / "shm" / "model"
    run = [sys.executable, str(STAGE), "--source", str(src), "--dest", str(dest), "--verify", "full"]
    staged = subprocess.run(run, capture_output=True, text=True, check=False)
    assert staged.returncode == 0, staged.stderr
    assert "every file's sha256 checked" in staged.stdout
    assert verify_manifest(dest, full=True).ok
    assert read_manifest(dest / "MANIFEST.json") == read_manifest(src / "MANIFEST.json")
    again = subprocess.run([*run, "--check"], capture_output=True, text=True, check=False)
    assert again.returncode == 0 and "already staged" in again.stdout, again.stdout + again.stderr


def test_a_digest_that_disagrees_fails_in_the_tool_and_in_the_trainer(tmp_path: Path) -> None:
    src = model(tmp_path)
    data = json.loads((src / "MANIFEST.json").read_text())
    data["files"][0]["sha256"] = "0" * 64
    (src / "MANIFEST.json").write_text(json.dumps(data))
    assert verify_manifest(src, full=True).problems == [
        f"{data['files'][0]['path']}: sha256 differs from the manifest"
    ]
    run = [sys.executable, str(STAGE), "--source", str(src), "--dest", str(tmp_path / "shm" / "model")]
    proc = subprocess.run(run, capture_output=True, text=True, check=False)
    assert proc.returncode == 1 and "sha256 differs from" in proc.stderr, proc.stderr


@pytest.mark.parametrize("case", ["not-json", "escapes", "twice"])
def test_a_malformed_manifest_is_one_line_naming_the_file_in_the_tool_and_the_trainer(
    tmp_path: Path, case: str
) -> None:
    src = tmp_path / "store"
    src.mkdir()
    (src / "MANIFEST.json").write_bytes(MANIFESTS[case])
    with pytest.raises(ManifestError) as trainer_error:
        read_manifest(src / "MANIFEST.json")
    assert verify_manifest(src).problems == [str(trainer_error.value)]
    run = [sys.executable, str(STAGE), "--source", str(src), "--dest", str(tmp_path / "shm" / "model")]
    proc = subprocess.run(run, capture_output=True, text=True, check=False)
    assert proc.returncode == 1
    assert proc.stderr == f"dflash-stage-model: error: {trainer_error.value}\n"
    assert str(trainer_error.value).startswith(f"{src / 'MANIFEST.json'}: ")


def test_the_trainer_never_lists_a_name_the_tools_refuse(tmp_path: Path) -> None:
    (tmp_path / "a").write_text("x")
    (tmp_path / ".dflash-sync.json").write_text("{}")  # a synced directory's own state
    (tmp_path / ".dflash-sync.lock").write_text("")
    write_manifest(tmp_path)
    assert [e["path"] for e in read_manifest(tmp_path / "MANIFEST.json")] == ["a"]
