"""File manifests: each file's relative path, size and sha256, as JSON; used to check staged data and models.

`check` compares sizes only unless full=True: a size check of 45 shards is instant, hashing 52 GB is not.
The full check streams each file through sha256 in 16 MiB reads, several files at once (hashlib releases the
GIL on large buffers, so threads hash in parallel); `CheckResult` says what was compared, so a caller never
reports "matches" without saying whether that meant sizes or hashes.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

MANIFEST_NAME = "MANIFEST.json"
_CHUNK = 16 << 20


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def hash_workers(requested: int | None = None) -> int:
    """Files hashed at once: one per core, at most 8 (beyond that the disk, not the CPU, is the limit)."""
    return max(1, requested or min(8, os.cpu_count() or 1))


def build_manifest(directory: Path) -> dict:
    directory = Path(directory)
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST_NAME)
    with concurrent.futures.ThreadPoolExecutor(hash_workers()) as pool:
        digests = list(pool.map(sha256_file, files))
    return {
        "version": 1,
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


def human_bytes(n: float) -> str:
    """Bytes in the largest unit that keeps a non-zero figure: 688 B, 1.6 KiB, 12.3 MiB, 52.1 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def verify_manifest(
    directory: Path, manifest: Path | None = None, *, full: bool = False, workers: int | None = None
) -> CheckResult:
    """Compares DIR with its manifest: sizes always, sha256 too when full. Files not listed are ignored."""
    directory = Path(directory)
    manifest = Path(manifest) if manifest else directory / MANIFEST_NAME
    result = CheckResult(hashed=full)
    try:
        entries = json.loads(manifest.read_text())["files"]
    except FileNotFoundError:
        result.problems.append(f"{manifest}: no manifest")
        return result
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        result.problems.append(f"{manifest}: not a manifest ({e})")
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
