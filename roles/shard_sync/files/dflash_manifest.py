"""File manifests: each file's relative path, size and sha256, as JSON; used to check staged data and models.

The format, {"version": 1, "files": [{"path": str, "size": int, "sha256": str}, ...]}, has this one module.
The trainer imports it as dflash_trainer.manifest (`dflash-train manifest`, preflight, rehearsals); the two
tools that run before any venv, dflash-stage-model (roles/model_stage) and dflash-s3-sync (roles/shard_sync),
import a byte-identical copy installed beside them as dflash_manifest.py (roles/*/files/dflash_manifest.py;
a test holds each copy to this file). So it imports the standard library only, and nothing of the trainer.

A manifest that is not one fails with a ManifestError naming the file (a JSON error its line and column, an
entry its index and key). `verify_manifest` compares sizes only unless full=True: a size check of 45 shards is
instant, hashing 52 GB is not. The full check streams each file through sha256 in 16 MiB reads, several files
at once (hashlib releases the GIL on large buffers, so threads hash in parallel); `CheckResult` says what was
compared, so a caller never reports "matches" without saying whether that meant sizes or hashes.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

MANIFEST_NAME = "MANIFEST.json"
VERSION = 1
RESERVED = ".dflash-sync"  # dflash-s3-sync's own files in a directory it mirrors (state, lock)
CHUNK = 16 << 20
HEX64 = re.compile(r"^[0-9a-f]{64}$")


class ManifestError(ValueError):
    """One line naming the manifest and what is wrong in it."""


def reserved(path: str, name: str = MANIFEST_NAME) -> bool:
    """A name no manifest lists: the manifest itself, or one of dflash-s3-sync's own files."""
    return path == name or path.rsplit("/", 1)[-1].startswith(RESERVED)


def parse_manifest(raw: bytes | str, where: str, *, name: str = MANIFEST_NAME) -> list[dict]:
    """The entries of a manifest's text, each {"path", "size", "sha256"}, sorted by path; a ManifestError
    naming `where` (its file or URI) otherwise. `name`: the manifest's own file name, which it cannot list."""
    try:
        text = raw.decode() if isinstance(raw, bytes) else raw
    except UnicodeDecodeError as e:
        raise ManifestError(f"{where}: not UTF-8 text ({e})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ManifestError(f"{where}: not JSON ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("files"), list):
        raise ManifestError(f'{where}: not a manifest (needs an object with a "files" list)')
    if data.get("version", VERSION) != VERSION:
        raise ManifestError(f"{where}: version {data.get('version')!r} is not supported ({VERSION} is)")
    seen: set[str] = set()
    entries = []
    for i, entry in enumerate(data["files"]):
        if not isinstance(entry, dict):
            raise ManifestError(f"{where}: files[{i}] is not an object")
        path, size, digest = entry.get("path"), entry.get("size"), entry.get("sha256")
        if not isinstance(path, str) or not path or path.startswith("/") or ".." in path.split("/"):
            raise ManifestError(
                f"{where}: files[{i}].path {path!r} is not a relative path inside the directory"
            )
        if reserved(path, name):
            raise ManifestError(f"{where}: files[{i}].path {path!r} is the manifest's or a tool's own file")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ManifestError(f"{where}: files[{i}].size {size!r} ({path}) is not a byte count")
        if not isinstance(digest, str) or not HEX64.match(digest):
            raise ManifestError(
                f"{where}: files[{i}].sha256 {digest!r} ({path}) is not 64 lowercase hex digits"
            )
        if path in seen:
            raise ManifestError(f"{where}: files[{i}].path {path!r} is listed twice")
        seen.add(path)
        entries.append({"path": path, "size": size, "sha256": digest})
    if not entries:
        raise ManifestError(f"{where}: lists no files")
    return sorted(entries, key=lambda e: e["path"])


def read_manifest(path: Path) -> list[dict]:
    """The entries of the manifest file at `path` (parse_manifest); a ManifestError naming it otherwise."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ManifestError(f"{path}: no manifest (write one with `dflash-train manifest DIR`)") from None
    except OSError as e:
        raise ManifestError(f"{path}: {e.strerror}") from None
    return parse_manifest(raw, str(path), name=path.name)


def sha256_file(path: Path, on_bytes: Callable[[int], None] | None = None) -> str:
    """The file's sha256 in CHUNK reads; on_bytes(n) after each read (a progress line counts them)."""
    h = hashlib.sha256()
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
            if on_bytes is not None:
                on_bytes(n)
    return h.hexdigest()


def hash_workers(requested: int | None = None) -> int:
    """Files hashed at once: one per core, at most 8 (beyond that the disk, not the CPU, is the limit)."""
    return max(1, requested or min(8, os.cpu_count() or 1))


def human_bytes(n: float) -> str:
    """Bytes in the largest unit that keeps a non-zero figure: 688 B, 1.6 KiB, 12.3 MiB, 52.1 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def build_manifest(directory: Path) -> dict:
    """The manifest of every file under `directory` but the reserved ones."""
    directory = Path(directory)
    files = sorted(
        p for p in directory.rglob("*") if p.is_file() and not reserved(p.relative_to(directory).as_posix())
    )
    with concurrent.futures.ThreadPoolExecutor(hash_workers()) as pool:
        digests = list(pool.map(sha256_file, files))
    return {
        "version": VERSION,
        "files": [
            {"path": p.relative_to(directory).as_posix(), "size": p.stat().st_size, "sha256": d}
            for p, d in zip(files, digests, strict=True)
        ],
    }


def write_manifest(directory: Path, out: Path | None = None) -> Path:
    """Writes the manifest of `directory` (default: DIR/MANIFEST.json) atomically; returns its path."""
    out = Path(out) if out else Path(directory) / MANIFEST_NAME
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(build_manifest(directory), indent=1) + "\n")
    tmp.replace(out)
    return out


@dataclass
class CheckResult:
    """What a manifest check compared and found."""

    files: int = 0
    bytes: int = 0
    hashed: bool = False
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def compared(self) -> str:
        """'sha256 of 4 files, 1.2 MiB in 0.1 s' or 'sizes of 4 files, contents not hashed (...)'."""
        if self.hashed:
            return f"sha256 of {self.files} files, {human_bytes(self.bytes)} in {self.seconds:.1f} s"
        return f"sizes of {self.files} files, contents not hashed (--full hashes them)"


def verify_manifest(
    directory: Path, manifest: Path | None = None, *, full: bool = False, workers: int | None = None
) -> CheckResult:
    """Compares DIR with its manifest: sizes always, sha256 too when full. Files not listed are ignored."""
    directory = Path(directory)
    manifest = Path(manifest) if manifest else directory / MANIFEST_NAME
    result = CheckResult(hashed=full)
    try:
        entries = read_manifest(manifest)
    except ManifestError as e:
        result.problems.append(str(e))
        return result
    start = time.perf_counter()
    result.files = len(entries)
    to_hash = []
    for entry in entries:
        path = directory / entry["path"]
        if not path.is_file():
            result.problems.append(f"{entry['path']}: missing")
            continue
        size = path.stat().st_size
        result.bytes += size
        if size != entry["size"]:
            result.problems.append(f"{entry['path']}: size {size}, manifest says {entry['size']}")
        elif full:
            to_hash.append(entry)
    if to_hash:
        with concurrent.futures.ThreadPoolExecutor(hash_workers(workers)) as pool:
            digests = pool.map(lambda e: sha256_file(directory / e["path"]), to_hash)
            for entry, digest in zip(to_hash, digests, strict=True):
                if digest != entry["sha256"]:
                    result.problems.append(f"{entry['path']}: sha256 differs from the manifest")
    result.seconds = time.perf_counter() - start
    return result


def check_manifest(directory: Path, manifest: Path | None = None, *, full: bool = False) -> list[str]:
    """Problems found (empty: the directory matches). Files not in the manifest are ignored."""
    return verify_manifest(directory, manifest, full=full).problems
